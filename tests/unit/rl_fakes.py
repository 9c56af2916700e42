"""Fake parts for the RL loop: no vLLM, no Ray, no model. Each records what the loop asked of it.

- `FakeGenerator` answers like `skylift.generator.Generator`: `n` trajectories per prompt, whose
  response ids encode (prompt index, sample, engine version) and whose reward comes from a rule
  the test chooses; it sleeps `delay_s` per call on the event loop, like an engine.
- `FakePolicy` is a model group whose logprobs are the rollout's and whose update records the
  trajectories of every mini-batch (decoded from the response ids).
- `FakeWeights` records syncs, labels and sleeps, and holds the engines' version.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from skylift.cluster.engine_weights import sync_metrics
from skylift.config import load_config
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptDataset, PromptSample, write_addition_demo
from skylift.generator import Trajectory
from skylift.inference.types import SamplingParams
from skylift.rl.build import make_source, samplers
from skylift.rl.console import Console
from skylift.rl.loop import RLTrainer
from skylift.rl.parts import Parts
from skylift.utils.loop_thread import LoopThread
from skylift.worker.batch import SequenceBatch

EOS = 2
PROMPT_LEN = 3

RewardRule = Callable[[int, int, int], float]
"""(prompt index, sample index, engine version) -> reward."""


def alternate(row: int, sample: int, version: int) -> float:
    """Every group has mixed rewards."""
    return float(sample % 2)


@dataclass
class Call:
    rows: list[int]
    n: int
    version: int
    seeds: list[int] | None
    thread: str


@dataclass
class FakeGenerator:
    reward: RewardRule = alternate
    delay_s: float = 0.0
    fail_after_calls: int | None = None
    fail_with: Callable[[], BaseException] | None = None
    calls: list[Call] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    async def generate(
        self,
        rows: list[PromptSample],
        n: int,
        params: SamplingParams,
        policy_version: int = 0,
        seeds: list[int] | None = None,
    ) -> list[Trajectory]:
        index = [row_index(row) for row in rows]
        if self.fail_after_calls is not None and len(self.calls) >= self.fail_after_calls:
            assert self.fail_with is not None
            raise self.fail_with()
        self.calls.append(Call(index, n, policy_version, seeds, threading.current_thread().name))
        self.events.append(f"generate {index[0]} v{policy_version}")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = []
        for row, i in zip(rows, index, strict=True):
            for j in range(n):
                response = [10 + i, 10 + j, 10 + policy_version, EOS]
                out.append(
                    Trajectory(
                        uid=row.uid,
                        prompt_ids=[5, 6, 7][:PROMPT_LEN],
                        response_ids=response,
                        loss_mask=[1] * len(response),
                        rollout_logprobs=[-1.0] * len(response),
                        reward=self.reward(i, j, policy_version),
                        stop_reason="stop",
                        data_source=row.data_source,
                        policy_version=policy_version,
                        token_versions=[policy_version] * len(response),
                    )
                )
        return out


def row_index(row: PromptSample) -> int:
    """The dataset row of a prompt (uid "<file>:<row>")."""
    return int(row.uid.split(":")[1])


def decode(batch: SequenceBatch) -> list[tuple[int, int, int]]:
    """(prompt index, sample index, engine version) of every row of a training batch."""
    out = []
    for ids in batch.response_ids.tolist():
        out.append((ids[0] - 10, ids[1] - 10, ids[2] - 10))
    return out


@dataclass
class FakePolicy:
    world_size: int = 1
    events: list[str] | None = None
    update_s: float = 0.0  # how long a mini-batch update takes (generation runs ahead meanwhile)
    trained: list[list[tuple[int, int, int]]] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)

    def compute_logprobs(self, batch: SequenceBatch, micro_batch_size: int, temperature: float) -> Any:
        return batch.extras["rollout_logprobs"].clone()

    def compute_values(self, batch: SequenceBatch, micro_batch_size: int) -> Any:
        return torch.zeros(batch.batch_size, batch.response_len)

    def train_mini_batch(
        self, batch: SequenceBatch, objective: Any, micro_batch_size: int, temperature: float
    ) -> dict[str, float]:
        self.trained.append(decode(batch))
        if self.update_s:
            time.sleep(self.update_s)
        if self.events is not None:
            self.events.append(f"train {len(self.trained)}")
        return {"loss": 0.0, "logprob_diff_vs_rollout": 0.0}

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.txt").write_text(str(len(self.trained)))
        self.saved.append(path)

    def load_checkpoint(self, path: str) -> None:
        self.loaded.append(path)

    def export_hf(self, path: str) -> str:
        return path


@dataclass
class FakeWeights:
    version: int = 0
    syncs: list[int] = field(default_factory=list)
    labels: int = 0
    sleeps: int = 0
    events: list[str] | None = None
    #: what each push returns, as a transport's push does (`EngineWeights.sync` turns it into the
    #: step's figures with `sync_metrics`)
    pushed: dict[str, float] = field(
        default_factory=lambda: {"timing/weight_sync_s": 0.25, "weight_sync/bytes": 2.5e6}
    )

    def sync(self, policy_version: int) -> dict[str, float]:
        self.syncs.append(policy_version)
        self.version = policy_version
        if self.events is not None:
            self.events.append(f"sync v{policy_version}")
        return sync_metrics("fake", self.pushed)

    def sleep(self) -> None:
        self.sleeps += 1
        if self.events is not None:
            self.events.append("sleep")

    def label(self) -> None:
        self.labels += 1


@dataclass
class FakeTracker:
    logged: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))


def demo_data(root: Path, num_train: int = 32, num_val: int = 4) -> tuple[PromptDataset, PromptDataset]:
    """Real prompt files (the demo's addition problems), written under `root`."""
    write_addition_demo(root, num_train=num_train, num_val=num_val, seed=0)
    return PromptDataset(root / "train.parquet"), PromptDataset(root / "validation.parquet")


def fake_config(root: Path, *overrides: str) -> SkyliftConfig:
    """A GRPO config for the fakes: batches of 4 prompts x 2 samples, no evaluation or checkpoints
    unless `overrides` ask for them."""
    return load_config(
        [
            "trainer.policy.model.path=fake",
            "trainer.train_batch_size=4",
            "trainer.policy_mini_batch_size=4",
            "generator.n_samples_per_prompt=2",
            "trainer.max_steps=4",
            "trainer.eval_interval=-1",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.resume_mode=none",
            f"trainer.ckpt_path={root / 'ckpts'}",
            f"trainer.export_path={root / 'exports'}",
            f"trainer.log_dir={root / 'logs'}",
            *overrides,
        ]
    )


def fake_decode(ids: list[int]) -> str:
    """A tokenizer's `decode` for the fakes' token ids: the ids, space-separated."""
    return " ".join(map(str, ids))


@dataclass
class FakeRun:
    trainer: RLTrainer
    generator: FakeGenerator
    policy: FakePolicy
    weights: FakeWeights
    tracker: FakeTracker
    loop: LoopThread

    def close(self) -> None:
        self.trainer.shutdown()
        self.loop.stop()


def fake_run(
    root: Path,
    *overrides: str,
    generator: FakeGenerator | None = None,
    num_train: int = 32,
    update_s: float = 0.0,
    policy: FakePolicy | None = None,
    tracking: Any = None,
) -> FakeRun:
    """An `RLTrainer` over fake parts, with the rollout source the overrides ask for (built by
    the same `make_source` a real run uses); `policy` replaces the default `FakePolicy`, `tracking`
    the `FakeTracker` the trainer logs to (e.g. a real `skylift.tracking.Tracking`)."""
    cfg = fake_config(root, *overrides)
    train, val = demo_data(root / "data", num_train=num_train)
    events: list[str] = []
    generator = generator or FakeGenerator()
    generator.events = events
    if policy is None:
        policy = FakePolicy(update_s=update_s)
    policy.events = events
    weights, tracker = FakeWeights(events=events), FakeTracker()
    loop = LoopThread(name="fake-run-loop")
    parts = Parts(
        train_data=train,
        val_data=val,
        generator=generator,
        loop=loop,
        policy=policy,
        weights=weights,
        tracking=tracking if tracking is not None else tracker,
        ckpt_dir=Path(cfg.trainer.ckpt_path or root / "ckpts"),
        export_dir=root / "exports",
        logs_dir=root / "logs",
        pad_id=0,
        decode=fake_decode,
    )
    sampler, evaluation = samplers(cfg, parts)
    total = min(
        train.num_batches(cfg.trainer.train_batch_size) * cfg.trainer.epochs, cfg.trainer.max_steps or 10**9
    )
    source = make_source(cfg, parts, sampler, total, Console(False).say)
    trainer = RLTrainer(cfg, parts, source, evaluation, total, Console(False))
    trainer.close_parts = lambda: None
    return FakeRun(trainer, generator, policy, weights, tracker, loop)
