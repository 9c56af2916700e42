"""Sampling-support replay against vLLM: the trainer's logprobs of tokens the engine sampled with
top-k, top-p and min-p equal the engine's processed logprobs (fp32 tiny model), on the padded,
packed and prefix-shared paths and with LoRA; and skylift's support equals vLLM's own sampler
functions on random logits, ties included. Uses the session's in-process engine (conftest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from skylift.algorithms.sample_support import TokenDistribution, support_mask, token_logprobs
from skylift.inference.types import SamplingParams
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.training_worker import TrainingWorker, WorkerSettings

pytestmark = pytest.mark.integration

PROMPTS = [[5, 17, 230, 999, 42, 8], [900, 3, 3, 64], [77, 12, 5], [400, 401, 402, 403, 404]]
CONFIGS = {  # name -> (top_k, top_p, min_p), temperature 1
    "top_p=1": (-1, 1.0, 0.0),
    "top_p=0.9": (-1, 0.9, 0.0),
    "top_p=0.7": (-1, 0.7, 0.0),
    "top_p=0.5": (-1, 0.5, 0.0),
    "top_k=20": (20, 1.0, 0.0),
    "top_k=20,top_p=0.7,min_p=0.05": (20, 0.7, 0.05),
}
WORKERS = {
    "padded": {},
    "packed": {"remove_microbatch_padding": True},
    "prefix-shared": {"share_prefixes": True},
    "lora": {"lora_rank": 4},  # the adapter starts at zero: the base model's logits
}


def _rollouts(engine: Any, loop: Any, dist: TokenDistribution, seed: int) -> SequenceBatch:
    params = SamplingParams(
        n=4,
        max_tokens=16,
        temperature=dist.temperature,
        top_k=dist.top_k,
        top_p=dist.top_p,
        min_p=dist.min_p,
        seed=seed,
        logprobs=True,
    )
    outputs = loop.run(engine.generate(PROMPTS, params))
    prompts, responses, logprobs = [], [], []
    for out in outputs:
        for comp in out.completions:
            prompts.append(out.prompt_token_ids)
            responses.append(comp.token_ids)
            logprobs.append(comp.logprobs)
    return build_sequence_batch(prompts, responses, per_token={"rollout_logprobs": logprobs})


def _gap(worker: TrainingWorker, batch: SequenceBatch, sampling: TokenDistribution) -> tuple[float, float]:
    """Mean and max |trainer - rollout| logprob per response token."""
    got = worker.compute_logprobs(batch, micro_batch_size=8, temperature=sampling)
    diff = (got - batch.extras["rollout_logprobs"]).abs()[batch.response_mask.bool()]
    return float(diff.mean()), float(diff.max())


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, TrainingWorker] = {}
    rdzv = tmp_path_factory.mktemp("rdzv")
    try:
        for name, settings in WORKERS.items():
            made[name] = TrainingWorker(
                WorkerSettings(model_path=str(tiny_model_dir), **settings),
                init_method=f"file://{rdzv / name}",
            )
            made[name].setup()
        yield made
    finally:
        for worker in made.values():
            worker.shutdown()


def test_trainer_logprobs_equal_the_engines_under_truncated_sampling(
    engine: Any, loop: Any, workers: dict[str, TrainingWorker]
) -> None:
    rows = []
    for i, (name, (top_k, top_p, min_p)) in enumerate(CONFIGS.items()):
        dist = TokenDistribution(top_k=top_k, top_p=top_p, min_p=min_p)
        batch = _rollouts(engine, loop, dist, seed=11 + i)
        before = _gap(workers["padded"], batch, dist.full())  # the untruncated distribution
        after = {path: _gap(worker, batch, dist) for path, worker in workers.items()}
        rows.append((name, before, after))
    print("\n|rollout - trainer| logprob per token, mean (max); before = untruncated scoring")
    for name, before, after in rows:
        cells = "  ".join(f"{p} {m:.1e} ({x:.1e})" for p, (m, x) in after.items())
        print(f"{name:32s} before {before[0]:.3g} ({before[1]:.3g})  after: {cells}")
    for name, before, after in rows:
        for path, (mean, worst) in after.items():
            assert worst <= 1e-5, (name, path, mean, worst)  # every token (issue 30)
        if name != "top_p=1":
            assert before[0] > 0.01, (name, before)  # the untruncated scoring was biased


def _vllm_processed(logits: torch.Tensor, dist: TokenDistribution) -> torch.Tensor:
    """vLLM's own sampler steps (V1, PyTorch path): temperature, min-p processor, top-k/top-p."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    x = logits.float().clone() / torch.full((logits.shape[0], 1), dist.temperature)
    if dist.min_p > 0:
        min_p = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # the state a batch of them sets
        min_p.min_p_count = logits.shape[0]
        min_p.min_p = torch.full((logits.shape[0], 1), dist.min_p)
        x = min_p.apply(x)
    vocab = logits.shape[-1]
    k = torch.full((logits.shape[0],), dist.top_k, dtype=torch.int32) if 0 < dist.top_k < vocab else None
    p = torch.full((logits.shape[0],), dist.top_p) if dist.top_p < 1 else None
    return apply_top_k_top_p(x, k, p).log_softmax(-1)


@pytest.mark.parametrize("name", list(CONFIGS)[1:])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_support_equals_vllms_sampler(name: str, ties: bool) -> None:
    top_k, top_p, min_p = CONFIGS[name]
    dist = TokenDistribution(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(128, 300, generator=gen) * 3
    if ties:
        logits = torch.randint(0, 8, (128, 300), generator=gen).float()
    want = _vllm_processed(logits, dist)
    assert torch.equal(support_mask(logits / dist.temperature, dist), want > float("-inf"))
    got = token_logprobs(logits, torch.arange(300).expand(128, 300), dist)
    finite = want > float("-inf")
    assert torch.allclose(got[finite], want[finite], atol=1e-6)
