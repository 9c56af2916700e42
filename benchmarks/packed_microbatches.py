"""Padding-free (packed) and prefix-shared micro-batches against padded ones, side by side in one process.

One training worker on SmolLM2-135M-Instruct (fp32, CPU) accumulates the gradients of the GRPO
objective over one mini-batch, padded (row-count micro-batches; rows that share a prompt share one
prompt forward), packed (`remove_microbatch_padding` with a token budget) and prefix-shared
(`share_prefixes`: each micro-batch's distinct prefixes once, row-count micro-batches), alternating,
best of `REPEATS`. Two batch shapes:

- `grpo`: the demo's shape, 8 prompts x 4 samples, prompts of 120-160 tokens shared by each
  group, responses of 8-64 tokens. The padded path runs each prompt once per group; packing runs
  it four times, so packing is expected to lose here.
- `distinct`: 32 distinct prompts of 20-160 tokens, responses of 8-64 tokens (SFT-like or one
  sample per prompt): padding is what the padded path wastes, and packing removes it.

ratio = packed / padded seconds on the `distinct` batch (lower is better); the `grpo` figures and
the prefix-shared ones (`grpo_shared_ratio` = shared / padded on the `grpo` batch) are printed
beside it. Run: `python benchmarks/packed_microbatches.py` (a few minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from skylift.algorithms import mini_batch_totals  # noqa: E402
from skylift.config.schema import OptimizerConfig  # noqa: E402
from skylift.models import prepare_model  # noqa: E402
from skylift.rl.objective import PolicyObjective  # noqa: E402
from skylift.worker.batch import SequenceBatch, build_sequence_batch  # noqa: E402
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings  # noqa: E402

REPEATS = 3
MICRO_ROWS = 8
TOKEN_BUDGET = 1200  # about what 8 padded rows of the distinct batch hold


def _batch(distinct: bool, seed: int = 0) -> SequenceBatch:
    gen = torch.Generator().manual_seed(seed)

    def ints(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    prompts, responses = [], []
    groups, group = (32, 1) if distinct else (8, 4)
    for _ in range(groups):
        prompt = torch.randint(5, 40000, (ints(20, 160) if distinct else ints(120, 160),), generator=gen)
        for _ in range(group):
            prompts.append(prompt.tolist())
            responses.append(torch.randint(5, 40000, (ints(8, 64),), generator=gen).tolist())
    batch = build_sequence_batch(prompts, responses)
    adv = torch.randn(len(prompts), 1, generator=gen).expand(-1, batch.response_len) * batch.response_mask
    return batch.with_extras(advantages=adv.contiguous())


def _time(worker: TrainingWorker, batch: SequenceBatch) -> float:
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    worker.zero_grad()
    tick = time.perf_counter()
    worker.accumulate_gradients(batch, objective, micro_batch_size=MICRO_ROWS)
    return time.perf_counter() - tick


def main() -> None:
    model = str(prepare_model("smollm2-135m-instruct"))
    rdzv = tempfile.mkdtemp(prefix="skylift-bench-")
    workers = {}
    for name, extra in (
        ("padded", {}),
        ("packed", {"remove_microbatch_padding": True, "max_tokens_per_microbatch": TOKEN_BUDGET}),
        ("shared", {"share_prefixes": True}),
    ):
        settings = WorkerSettings(
            model_path=model, optimizer=OptimizerSettings(OptimizerConfig(lr=1e-6, weight_decay=0.0)), **extra
        )
        workers[name] = TrainingWorker(settings, init_method=f"file://{rdzv}/{name}")
        workers[name].setup()
    figures: dict[str, float] = {}
    for shape in ("distinct", "grpo"):
        batch = _batch(distinct=shape == "distinct")
        real = int(batch.attention_mask.sum())
        best = {name: float("inf") for name in workers}
        for _ in range(REPEATS):
            for name, worker in workers.items():
                best[name] = min(best[name], _time(worker, batch))
        for name in workers:
            figures[f"{shape}_{name}_s"] = round(best[name], 3)
        figures[f"{shape}_real_tokens"] = real
        figures[f"{shape}_padded_cells"] = int(batch.attention_mask.numel())
        print(
            f"[bench] {shape}: {batch.batch_size} rows, {real} real tokens | padded {best['padded']:.2f} s, "
            f"packed {best['packed']:.2f} s, packed/padded {best['packed'] / best['padded']:.2f}, "
            f"prefix-shared {best['shared']:.2f} s, shared/padded {best['shared'] / best['padded']:.2f}"
        )
    for worker in workers.values():
        worker.shutdown()
    figures["grpo_ratio"] = round(figures["grpo_packed_s"] / figures["grpo_padded_s"], 3)
    figures["grpo_shared_ratio"] = round(figures["grpo_shared_s"] / figures["grpo_padded_s"], 3)
    ratio = round(figures["distinct_packed_s"] / figures["distinct_padded_s"], 3)
    print(json.dumps({"ratio": ratio, **figures, "load_1min": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
