"""A LoRA policy trained end to end: the trainer on Ray (placement ray) with a Ray engine actor
started with LoRA; every step's sync sends only the adapter, in memory over the weight-update
group, and the engine then samples with the adapter of the latest version. Run inside a
loopback-only namespace:
    bash scripts/test.sh tests/integration/test_lora_trainer.py
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lora_helpers import SEQUENCES, TOLERANCE

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.envs import Environment, StepResult, register_env
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration

ENV = "test_lora_even_length"


@register_env(ENV, override=True)
class EvenLengthEnv(Environment):
    """Reward 1 for a response of even character length: GRPO groups of the untrained tiny model
    get non-zero advantages, so the adapter moves away from PEFT's identity start."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


def _data(out: Path) -> Path:
    write_arithmetic_dataset(out, num_train=16, num_val=4, seed=0)
    for split in ("train", "validation"):
        table = pq.read_table(out / f"{split}.parquet")
        column = pa.array([ENV] * table.num_rows)
        index = table.schema.get_field_index("env_class")
        pq.write_table(table.set_column(index, "env_class", column), out / f"{split}.parquet")
    return out


def _logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, t].item() for i, t in enumerate(tokens) if i > 0]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def test_lora_policy_two_steps_on_ray_engines(tiny_model_dir: Path, tmp_path: Path) -> None:
    from server_helpers import require_loopback_namespace
    from transformers import AutoModelForCausalLM

    require_loopback_namespace()
    data = _data(tmp_path / "data")
    overrides = {
        "trainer.policy.model.path": str(tiny_model_dir),
        "trainer.policy.model.lora.rank": 8,
        "trainer.policy.model.lora.alpha": 16,
        "trainer.placement.backend": "ray",
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": f"['{data / 'validation.parquet'}']",
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 16,
        "trainer.max_prompt_length": 128,
        "trainer.max_steps": 2,
        "trainer.eval_interval": -1,
        "trainer.eval_before_train": False,
        "trainer.policy.optimizer_config.lr": 3e-2,
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
    }
    trainer = build_trainer(load_config([f"{k}={v}" for k, v in overrides.items()]), console=False)
    try:
        trainer.setup()
        history = trainer.fit()
        rows = [h for h in history if "reward/mean" in h]
        assert [h["step"] for h in rows] == [1, 2]
        # each step's rollouts came from the engine holding the adapter the trainer scores with
        assert all(h["policy/logprob_diff_vs_rollout"] < TOLERANCE for h in rows)
        assert trainer.parts.engines is not None
        engine = trainer.parts.loop.run(trainer.parts.engines.prompt_logprobs(SEQUENCES))
        exported = trainer.export()  # the policy after step 2, the adapter merged
    finally:
        trainer.shutdown()
    trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    want = [_logprobs(trained, seq) for seq in SEQUENCES]
    # the training moved the model: an engine without the latest adapter would be off
    assert _max_diff([_logprobs(base, seq) for seq in SEQUENCES], want) > 1e-2
    assert _max_diff(engine, want) < TOLERANCE
