"""A vLLM pooling engine that scores token rows with a reward model (the ``reward_model``
environment's ``vllm`` backend, `skylift.envs.reward_model`).

vLLM loads a ``*ForSequenceClassification`` directory with ``runner="pooling"`` (its classify
task: the last token's hidden state through the head). Its classify output applies the activation
(a sigmoid for one label) unless asked not to; a reward model's score is the raw logit, so every
request asks ``use_activation=False``. vLLM reads each row's last token; `skylift`'s torch path
reads the last token that is not the padding id, which is the same token unless a row ends with
the padding id.
"""

from __future__ import annotations

import threading
from typing import Any

from skylift.envs.reward_model import SCORER_FACTORIES, RewardModelScorer
from skylift.inference.reward_scoring import RewardScorer

SHUTDOWN_TIMEOUT_S = 30.0


class VLLMPoolingScorer(RewardScorer):
    """A vLLM ``LLM`` (pooling runner) over the reward model, one call at a time."""

    def __init__(self, path: str, batch_size: int, max_model_len: int = 4096) -> None:
        """`max_model_len`: the longest row scored, at most the model's own maximum."""
        from vllm import LLM

        from skylift.inference.engine_args import kv_cache_bytes
        from skylift.models import resolve_model_path

        super().__init__(path)
        model = resolve_model_path(path)
        max_model_len = min(max_model_len, _max_positions(model) or max_model_len)
        max_num_seqs = max(batch_size, 1)
        self.llm: Any = LLM(
            model=model,
            runner="pooling",
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_bytes(None, model, max_model_len, max_num_seqs),
        )
        self._lock = threading.Lock()

    def score_rows(self, rows: list[list[int]]) -> list[float]:
        from vllm import PoolingParams

        prompts: Any = [{"prompt_token_ids": r} for r in rows]
        with self._lock:
            if self.llm is None:
                raise RuntimeError(f"reward model {self.path}: the vLLM pooling engine is closed")
            outputs = self.llm.classify(
                prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False
            )
        return [float(o.outputs.probs[0]) for o in outputs]

    def close(self) -> None:
        """Stop the engine's processes (idempotent)."""
        import gc

        llm, self.llm = self.llm, None
        if llm is None:
            return
        with self._lock:
            llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        del llm
        gc.collect()  # the engine's finalisers now, not during interpreter teardown


def _max_positions(model: str) -> int | None:
    """The model's longest sequence (vLLM refuses a longer ``max_model_len``), if its config says."""
    from transformers import AutoConfig

    positions = getattr(AutoConfig.from_pretrained(model).get_text_config(), "max_position_embeddings", None)
    return int(positions) if positions else None


def make_pooling_scorer(path: str, backend: str, batch_size: int) -> RewardModelScorer | None:
    """The ``vllm`` backend (None for another)."""
    return VLLMPoolingScorer(path, batch_size) if backend == "vllm" else None


SCORER_FACTORIES.register(make_pooling_scorer)

__all__ = ["VLLMPoolingScorer", "make_pooling_scorer"]
