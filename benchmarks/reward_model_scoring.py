"""Scoring rollouts with a reward model: a Ray actor holding it in torch vs a vLLM pooling engine.

The two scorers of the ``reward_model`` environment (`skylift.inference.reward_scoring`:
``actor``; `skylift.inference.reward_pooling`: ``vllm``) score the same rollouts the way a GRPO
run asks them to: GROUPS groups of N conversations (a prompt and a response of mixed length),
one call per group, one group after another. The reward model is SmolLM2-135M-Instruct with a
seeded new scalar head (fp32; scoring time does not depend on what the head learned). Each
scorer is started once (its start-up time is reported apart), warmed up with one group, then the
whole set is scored ROUNDS times, the two scorers alternating; the figure is the median round.
The scores of the two must agree (max |difference| reported; the run fails above 1e-3).

Last stdout line: JSON with "ratio" = pooling time / actor time (below 1: vLLM is faster) and
the raw figures.

    flock /tmp/skylift-heavy.lock bash scripts/loopback.sh .venv/bin/python benchmarks/reward_model_scoring.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

GROUPS = 8
N = 8
ROUNDS = 3
MODEL = "smollm2-135m-instruct"


def conversations(seed: int = 0) -> list[list[list[dict[str, Any]]]]:
    rng = random.Random(seed)
    words = "the sum of these two numbers is so we carry one and add the tens then units".split()
    out = []
    for _ in range(GROUPS):
        a, b = rng.randrange(1000), rng.randrange(1000)
        prompt = [{"role": "user", "content": f"What is {a} + {b}? Think step by step."}]
        group = []
        for _ in range(N):
            reasoning = " ".join(rng.choice(words) for _ in range(rng.randrange(10, 200)))
            answer = a + b + rng.choice([0, 0, 1, -1, 10])
            group.append([*prompt, {"role": "assistant", "content": f"{reasoning}. #### {answer}"}])
        out.append(group)
    return out


def reward_model_dir(root: Path) -> Path:
    import torch
    from transformers import AutoTokenizer

    from skylift.models import prepare_model
    from skylift.models.reward_model import load_reward_model

    base = prepare_model(MODEL)
    torch.manual_seed(0)
    out = root / "rm"
    load_reward_model(str(base)).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def score_all(scorer: Any, groups: list[list[list[dict[str, Any]]]]) -> tuple[float, list[float]]:
    started = time.perf_counter()
    scores: list[float] = []
    for group in groups:
        scores += scorer.score_conversations(group)
    return time.perf_counter() - started, scores


def main() -> None:
    import ray

    from skylift.inference.reward_pooling import VLLMPoolingScorer
    from skylift.inference.reward_scoring import RayActorScorer

    groups = conversations()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(reward_model_dir(Path(tmp)))
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=os.cpu_count() or 2)
        began = time.perf_counter()
        actor = RayActorScorer(path, batch_size=N)
        actor.score_conversations(groups[0])  # the actor has loaded the model once this returns
        actor_start = time.perf_counter() - began
        began = time.perf_counter()
        pooling = VLLMPoolingScorer(path, batch_size=N)
        pooling.score_conversations(groups[0])
        pooling_start = time.perf_counter() - began
        actor_s: list[float] = []
        pooling_s: list[float] = []
        for _ in range(ROUNDS):
            seconds, actor_scores = score_all(actor, groups)
            actor_s.append(seconds)
            seconds, pooling_scores = score_all(pooling, groups)
            pooling_s.append(seconds)
        pooling.close()
        actor.close()
        ray.shutdown()
    rows = GROUPS * N
    diff = max(abs(a - b) for a, b in zip(actor_scores, pooling_scores, strict=True))
    actor_t, pooling_t = statistics.median(actor_s), statistics.median(pooling_s)
    tokens = sum(len(m[-1]["content"]) for g in groups for m in g)
    print(
        f"{rows} rollouts in {GROUPS} groups of {N} ({tokens} response characters), {MODEL} reward model, fp32"
    )
    print(
        f"ray actor (torch):   {actor_t:.3f} s ({rows / actor_t:.1f} rollouts/s); start-up {actor_start:.1f} s"
    )
    print(
        f"vLLM pooling engine: {pooling_t:.3f} s ({rows / pooling_t:.1f} rollouts/s); start-up {pooling_start:.1f} s"
    )
    print(f"max |score difference| {diff:.2e}")
    if diff > 1e-3:
        raise SystemExit(f"the two scorers disagree: max |difference| {diff:.2e}")
    result = {
        "ratio": round(pooling_t / actor_t, 4),
        "pooling_s": round(pooling_t, 4),
        "actor_s": round(actor_t, 4),
        "pooling_rounds_s": [round(s, 4) for s in pooling_s],
        "actor_rounds_s": [round(s, 4) for s in actor_s],
        "pooling_startup_s": round(pooling_start, 2),
        "actor_startup_s": round(actor_start, 2),
        "rollouts": rows,
        "group_size": N,
        "max_abs_score_diff": diff,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
