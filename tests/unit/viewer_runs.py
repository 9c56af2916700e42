"""Run folders for `skylift view`'s tests, written by the run's own record writer.

The trajectories come from skylift's real `Generator` (its single-turn path and its multi-turn
agent loop with the real `calculator` and `gsm8k` environments) driven by a scripted engine and a
real tokenizer; their experience from the real `make_experience`; the records from
`RolloutRecorder` and the step times from `JsonlTracker`. Only the engine's tokens and the trainer's
logprobs are chosen here: the trainer's differ from the engine's by a seeded noise, with a few
tokens far apart, as a mismatch the viewer must show.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer

from skylift.config.records import RolloutRecordsConfig
from skylift.data.tool_demo import tool_call_text, tool_demo_row
from skylift.generator import Generator, GeneratorSettings, Trajectory
from skylift.inference.types import SamplingParams
from skylift.rl.experience import ExperienceStages, make_experience
from skylift.rl.rollout_records import RolloutRecorder
from skylift.rl.staleness import StalenessPolicy
from skylift.tracking.trackers import JsonlTracker

PAIRS = [(47, 382), (23, 456), (91, 17)]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [tokenizer.eos_token_id]


def _rollout(tokenizer: Any, row: Row, replies: list[Reply], max_turns: int, version: int) -> Trajectory:
    settings = GeneratorSettings(max_turns=max_turns, max_prompt_length=1024)
    generator = Generator(ScriptedEngine(replies), tokenizer, settings)
    (trajectory,) = asyncio.run(generator.generate([row], 1, SamplingParams(max_tokens=48), version))
    return trajectory


def rows(task: str) -> list[Row]:
    """The prompts of `task`: the tool demo's (system message, question) or the addition demo's."""
    if task == "tools":
        specs = [tool_demo_row(a, b, "train", i) for i, (a, b) in enumerate(PAIRS)]
        keys = ("prompt", "env_class", "reward_spec", "extra_info", "data_source")
        return [
            Row(*(s[k] for k in keys[:2]), f"0:{i}", *(s[k] for k in keys[2:])) for i, s in enumerate(specs)
        ]
    out = []
    for i, (a, b) in enumerate([(12, 30), (45, 27)]):
        prompt = [{"role": "user", "content": f"What is {a} + {b}? Give the final answer after ####."}]
        out.append(Row(prompt, "gsm8k", f"0:{i}", {"ground_truth": str(a + b)}, {}, "skylift/addition-demo"))
    return out


def tool_trajectories(tokenizer: Any, step: int) -> list[Trajectory]:
    """Three calculator prompts x four samples: a call then the right answer, a call then a wrong
    one, the right answer without the tool, and an answer cut off at the length limit."""
    out = []
    for row, (a, b) in zip(rows("tools"), PAIRS, strict=True):
        scripts = [
            [tool_call_text(a, b), f"#### {a * b}"],
            [tool_call_text(a, b), f"The product is #### {a * b + 10 * (step + 1)}"],
            [f"#### {a * b}"],
            ["Let me think step by step about " + " and ".join([f"{a} times {b}"] * 12)],
        ]
        for k, script in enumerate(scripts):
            replies = [Reply(_ids(tokenizer, text)) for text in script]
            if k == 3:
                replies = [Reply(_ids(tokenizer, script[0]), stop_reason="length")]
            out.append(_rollout(tokenizer, row, replies, 3, step - 1))
    return out


def addition_trajectories(tokenizer: Any, step: int) -> list[Trajectory]:
    """The demo's task (two-digit addition, scored by gsm8k's `####` answer): 2 prompts x 4 samples."""
    out = []
    for row, (a, b) in zip(rows("addition"), [(12, 30), (45, 27)], strict=True):
        for k in range(4):
            answer = a + b if (k + step) % 2 == 0 else a + b + k
            out.append(
                _rollout(tokenizer, row, [Reply(_ids(tokenizer, f"{a} + {b} = #### {answer}"))], 1, step - 1)
            )
    return out


def _trainer_logprobs(step: int) -> Any:
    """The trainer's logprobs: the engine's plus a seeded noise, every 7th token 0.2 above, every 11th 0.15 below."""

    def logprobs(batch: Any) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step)
        rollout = batch.extras["rollout_logprobs"]
        noise = torch.randn(rollout.shape, generator=gen) * 2e-3
        noise.view(-1)[::7] += 0.2
        noise.view(-1)[3::11] -= 0.15
        return (rollout + noise) * batch.response_mask

    return logprobs


def write_run(root: Path, task: str = "tools", steps: int = 2) -> Path:
    """A run folder `root` (logs in `root/logs`) of `steps` recorded training steps and an
    evaluation after each, for `task` "tools" (multi-turn) or "addition" (the demo's)."""
    tokenizer = chatml_tokenizer()
    make = tool_trajectories if task == "tools" else addition_trajectories
    logs = root / "logs"
    cfg = RolloutRecordsConfig(interval=1, groups_per_step=4, eval_prompts=4, tracker_rows=0)
    prompts = {row.uid: row.prompt for row in rows(task)}  # as from_parts indexes the run's data
    recorder = RolloutRecorder(cfg, logs, tokenizer.decode, lambda: prompts)
    metrics = JsonlTracker(logs)
    stages = ExperienceStages.of(staleness=StalenessPolicy(old_logprobs="trainer"))
    for step in range(1, steps + 1):
        trajectories = make(tokenizer, step)
        experience = make_experience(trajectories, stages, step - 1, policy_logprobs=_trainer_logprobs(step))
        timing = recorder.step(step, experience, trajectories)
        recorder.evaluation(step, make(tokenizer, step + 1))
        parts = {
            "generate_s": 3.0 + step,
            "wait_s": 0.2,
            "logprobs_s": 0.8,
            "train_s": 4.5,
            "weight_sync_s": 0.6,
        }
        row = {f"timing/{k}": v for k, v in parts.items()} | timing
        row["timing/step_s"] = sum(row.values()) + 0.1
        metrics.log({**experience.metrics, **row}, step)
    metrics.close()
    return root
