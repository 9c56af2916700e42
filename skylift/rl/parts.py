"""What the RL loop is given: the parts of a run, as the interfaces the loop uses.

`skylift.cluster.runtime.Runtime` builds the real ones (vLLM engines, FSDP2 worker groups, Ray);
unit tests build fakes (`tests/unit/rl_fakes.py`). The loop never builds or looks behind a part.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from skylift.algorithms.sample_support import Sampling
from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.inference.types import SamplingParams
from skylift.utils.loop_thread import LoopThread
from skylift.worker.batch import SequenceBatch


class RolloutGenerator(Protocol):
    """Samples responses for prompts and has the environments score them."""

    def generate(
        self,
        rows: list[PromptSample],
        n: int,
        params: SamplingParams,
        engine_version: int | Callable[[], int],
        seeds: list[int] | None,
    ) -> Coroutine[Any, Any, list[Trajectory]]: ...


class ModelGroup(Protocol):
    """The ranks of one model (policy, reference or critic): forward passes, updates, checkpoints."""

    world_size: int

    def compute_logprobs(self, batch: SequenceBatch, micro_batch_size: int, temperature: Sampling) -> Any: ...

    def compute_values(self, batch: SequenceBatch, micro_batch_size: int) -> Any: ...

    def train_mini_batch(
        self, batch: SequenceBatch, objective: Any, micro_batch_size: int, temperature: Sampling
    ) -> dict[str, float]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf(self, path: str) -> str: ...


class EngineWeightsLike(Protocol):
    """The engines' copy of the policy (`skylift.cluster.engine_weights.EngineWeights`)."""

    version: int

    def sync(self, policy_version: int) -> dict[str, float]: ...

    def sleep(self) -> None: ...

    def label(self) -> None: ...


class EngineHealth(Protocol):
    """Which engines still serve (`skylift.inference.pool.EnginePool`)."""

    @property
    def failures(self) -> Any: ...

    @property
    def live_indices(self) -> list[int]: ...


class MetricsLog(Protocol):
    """Where a step's metrics go (`skylift.tracking.Tracking`: every configured tracker)."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...


class PromptData(Protocol):
    """A prompt dataset (`skylift.data.PromptDataset`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> PromptSample: ...

    def num_batches(self, batch_size: int, drop_last: bool = True) -> int: ...

    def epoch_order(self, epoch: int, seed: int, shuffle: bool = True) -> Any: ...


@dataclass
class Parts:
    """One run's parts. `loop` is the run's event loop, on its thread (the engines' clients live
    on it; `skylift.utils.loop_thread`)."""

    train_data: PromptData
    val_data: Sequence[PromptSample] | None
    generator: RolloutGenerator
    loop: LoopThread
    policy: ModelGroup
    weights: EngineWeightsLike
    tracking: MetricsLog
    ckpt_dir: Path
    export_dir: Path
    logs_dir: Path
    pad_id: int
    ref: ModelGroup | None = None
    critic: ModelGroup | None = None
    engines: EngineHealth | None = None
    sleep_engines: bool = False
    """Colocated engines sleep while the policy trains (GPUs only)."""
    decode: Callable[[list[int]], str] | None = None
    """Token ids to text (the run's tokenizer), for the registered evaluation dumpers (None: not
    written)."""
