"""Routing replay on the tiny Qwen3-MoE: how often engine and trainer route a token differently,
the logprob gap with and without replaying the engine's routing, and what replay costs a step.

The model is `tiny-qwen3-moe` after a few Adam updates (so its routers are no longer at their
random start). A skylift engine (vLLM, bf16 weights; `enable_return_routed_experts`, on CPU
through skylift's `cpu_routed_experts` patch) samples completions and returns each token's routed
experts. The trainer's model (fp32, transformers) scores the same tokens
- without replay: its own routers pick the experts; the share of (token, MoE layer) pairs whose
  expert set differs from the engine's, and the mean |logprob gap| of the sampled tokens;
- with replay (`skylift.worker.routing_replay.replay_routing`): the engine's experts; the same two
  figures (the routing difference is 0 by construction, checked).
Step time: a forward and backward over the batch, with and without replay, alternating, median
of the rounds. Last stdout line: JSON with "ratio" (step time with replay / without; goal <= 1.1)
and the raw figures.

    bash scripts/loopback.sh .venv/bin/python benchmarks/routing_replay.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from skylift.models import prepare_model
from skylift.worker.routing_replay import RoutingTally, moe_routers, replay_routing, routing_of

PROMPTS = 16
PROMPT_LEN = 24
MAX_TOKENS = 24
UPDATES = 5
ROUNDS = 7


def trained_model_dir(out: Path) -> Path:
    """tiny-qwen3-moe after UPDATES Adam steps of next-token loss on random token sequences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = prepare_model("tiny-qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(UPDATES):
        ids = torch.randint(10, model.config.vocab_size, (8, 32), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def engine_samples(model_dir: Path) -> list[dict[str, Any]]:
    """Each prompt's token ids, sampled ids, their engine logprobs and routed experts: a skylift
    engine (vLLM in bf16, `enable_return_routed_experts`; on CPU through skylift's
    `cpu_routed_experts` patch)."""
    import asyncio

    from skylift.inference.engine_args import apply_cpu_env_defaults
    from skylift.inference.local import LocalVLLMEngine
    from skylift.inference.types import SamplingParams

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (PROMPT_LEN,), generator=generator).tolist() for _ in range(PROMPTS)]

    async def sample() -> list[Any]:
        apply_cpu_env_defaults()
        engine = await LocalVLLMEngine.create(
            str(model_dir),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=PROMPT_LEN + MAX_TOKENS,
            max_num_seqs=PROMPTS,
            seed=0,
            enable_return_routed_experts=True,
        )
        try:
            return await engine.generate(
                prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=0)
            )
        finally:
            await engine.close()

    samples = []
    for prompt, output in zip(prompts, asyncio.run(sample()), strict=True):
        (completion,) = output.completions
        samples.append(
            {
                "prompt": prompt,
                "sampled": list(completion.token_ids),
                "logprobs": list(completion.logprobs or []),
                "routed": torch.as_tensor(completion.routed_experts).long(),
            }
        )
    return samples


def trainer_figures(model: Any, samples: list[dict[str, Any]]) -> dict[str, float]:
    """Routing disagreement and logprob gap, without and with replay, over the sampled tokens."""
    layers = sorted(moe_routers(model))
    differ = total = 0
    gaps: dict[str, list[float]] = {"without": [], "with": []}
    replay_differ = 0
    for sample in samples:
        ids = torch.tensor([sample["prompt"] + sample["sampled"]])
        routed = sample["routed"]  # [tokens the engine ran, layers, top_k]
        rows = routed.shape[0]
        own = routing_of(model, input_ids=ids[:, :rows])
        engine_sets = routed[:, layers].sort(-1).values
        differ += int((own[:, layers].sort(-1).values != engine_sets).any(-1).sum())
        total += rows * len(layers)
        start = len(sample["prompt"])
        want = torch.tensor(sample["logprobs"][: rows - start + 1])
        for mode in ("without", "with"):
            with torch.no_grad():
                if mode == "with":
                    with replay_routing(model, routed):
                        logits = model(input_ids=ids[:, :rows]).logits[0]
                    with replay_routing(model, routed):
                        replay_differ += int(
                            (
                                routing_of(model, input_ids=ids[:, :rows])[:, layers].sort(-1).values
                                != engine_sets
                            )
                            .any(-1)
                            .sum()
                        )
                else:
                    logits = model(input_ids=ids[:, :rows]).logits[0]
            logp = torch.log_softmax(logits.float(), -1)
            targets = ids[0, start:rows]
            got = logp[start - 1 : rows - 1].gather(-1, targets[:, None])[:, 0]
            gaps[mode] += (got - want[: len(got)]).abs().tolist()
    return {
        "routing_disagreement_without_replay": differ / total,
        "routing_disagreement_with_replay": replay_differ / total,
        "lp_gap_without_replay": statistics.fmean(gaps["without"]),
        "lp_gap_with_replay": statistics.fmean(gaps["with"]),
        "routings_compared": float(total),
    }


def step_times(model: Any, samples: list[dict[str, Any]]) -> tuple[float, float]:
    """Median seconds of a forward+backward over the batch: (without replay, with replay)."""
    rows = min(s["routed"].shape[0] for s in samples)
    ids = torch.tensor([(s["prompt"] + s["sampled"])[:rows] for s in samples])
    routed = torch.cat([s["routed"][:rows] for s in samples])

    def step(replay: bool) -> float:
        started = time.perf_counter()
        if replay:  # as the trainer's update does: with the tally of what replay overrode
            with replay_routing(model, routed, RoutingTally()):
                loss = model(input_ids=ids).logits.logsumexp(-1).mean()
        else:
            loss = model(input_ids=ids).logits.logsumexp(-1).mean()
        loss.backward()
        model.zero_grad()
        return time.perf_counter() - started

    step(False), step(True)  # warm-up
    plain, replayed = [], []
    for _ in range(ROUNDS):
        plain.append(step(False))
        replayed.append(step(True))
    return statistics.median(plain), statistics.median(replayed)


def main() -> None:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = trained_model_dir(Path(tmp))
        samples = engine_samples(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    figures = trainer_figures(model.eval(), samples)
    without, with_replay = step_times(model.train(), samples)
    figures.update(step_s_without_replay=without, step_s_with_replay=with_replay)
    engine = f"vllm-bf16 ({'cuda' if torch.cuda.is_available() else 'cpu'})"
    print(f"engine: {engine}")
    for key, value in figures.items():
        print(f"{key}: {value:.4g}")
    print(json.dumps({"ratio": with_replay / without, "engine": engine, **figures}))


if __name__ == "__main__":
    main()
