"""A training worker's state in host memory while colocated engines use the GPU, and back.

Under `trainer.placement.colocate_all=true` on GPUs the trainer and the inference engines take
turns on the same devices: the engines sleep while the policy trains, and the trainer's
parameters (with any gradients and buffers) and its optimizer state wait in host memory while the
engines are awake (`trainer.*.optimizer_config.offload_after_step`: the optimizer state too, as
in SkyRL). `HostOffload` moves one model's and one optimizer's tensors to host copies and back to
the devices they came from; `OffloadingWorker` gives a training worker `offload_to_host` /
`backload_to_device`, and brings its state back before any method that needs it (a forward, a
step, a checkpoint), so an operation never runs on offloaded state.

Every tensor is copied, also where it already lives on the host (on CPU the "device" is host
memory: the move is then bookkeeping, which is what the unit tests check: a round trip is exact
and an optimizer step after it equals one without). On CUDA the host copies are pinned (faster
transfers), and the freed device memory goes back to the driver (`torch.cuda.empty_cache`), where
vLLM's allocator can take it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: The two parts of a worker's state that move separately.
MODEL = "model"  # parameters, their gradients, buffers
OPTIMIZER = "optimizer"  # the optimizer's per-parameter state (AdamW's moments, step)
PARTS = (MODEL, OPTIMIZER)


def _check_parts(parts: Iterable[str]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(parts))
    unknown = [p for p in out if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown offload part(s) {unknown}; the parts are {list(PARTS)}")
    return out


def _nbytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
    return int(local.numel() * local.element_size())


class HostOffload:
    """Host copies of one model's tensors and one optimizer's state, and the way back.

    `offload(parts)` replaces the tensors of the named parts (`"model"`, `"optimizer"`) with copies
    in host memory, remembering each tensor's device; `backload(parts)` copies them back there.
    Parameter objects stay the same (the optimizer keeps referring to them: the module's own
    `_apply`, which FSDP2's sharded modules also re-register their shards through). Moving a part
    that is already where it is asked to go does nothing.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._devices: dict[str, list[torch.device]] = {}  # offloaded part -> devices, in visit order

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The parts in host memory now."""
        return tuple(p for p in PARTS if p in self._devices)

    def offload(self, parts: Iterable[str] = PARTS) -> int:
        """Copy `parts` to host memory and drop their device tensors; returns the bytes moved."""
        moved = 0
        for part in _check_parts(parts):
            if part in self._devices or (part == OPTIMIZER and self.optimizer is None):
                continue
            devices: list[torch.device] = []
            pin = False

            def to_host(t: torch.Tensor, devices: list[torch.device] = devices) -> torch.Tensor:
                nonlocal moved, pin
                devices.append(t.device)
                moved += _nbytes(t)
                if t.device.type == "cuda":
                    pin = True
                    return t.to("cpu", non_blocking=True)  # into pinned memory
                return t.to("cpu", copy=True)

            self._move(part, to_host)
            if pin:
                torch.cuda.synchronize()  # the non-blocking copies are done before anything reads them
            self._devices[part] = devices
        release_device_cache()
        return moved

    def backload(self, parts: Iterable[str] = PARTS) -> int:
        """Copy `parts` back to the devices they came from; returns the bytes moved."""
        moved = 0
        for part in _check_parts(parts):
            devices = self._devices.pop(part, None)
            if devices is None:
                continue
            order = iter(devices)
            cuda = False

            def to_device(t: torch.Tensor, order: Iterator[torch.device] = order) -> torch.Tensor:
                nonlocal moved, cuda
                device = next(order)
                moved += _nbytes(t)
                cuda = cuda or device.type == "cuda"
                return t.to(device, copy=True, non_blocking=device.type == "cuda")

            self._move(part, to_device)
            if cuda:
                torch.cuda.synchronize()
        return moved

    def _move(self, part: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        with torch.no_grad():
            if part == MODEL:
                self.model._apply(fn)  # parameters (same objects), their gradients, buffers
                return
            assert self.optimizer is not None
            for group in self.optimizer.param_groups:  # parameter order: the same on every visit
                for param in group["params"]:
                    state = self.optimizer.state.get(param)
                    if not state:
                        continue
                    for key in sorted(state):
                        if isinstance(state[key], torch.Tensor):
                            state[key] = fn(state[key])


def release_device_cache() -> None:
    """Give the CUDA caching allocator's free blocks back to the driver (others may take them)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def device_memory() -> dict[str, float]:
    """This process's CUDA memory now and at its peak, in GiB (empty without CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    gib = float(1 << 30)
    return {
        "allocated_gib": torch.cuda.memory_allocated() / gib,
        "reserved_gib": torch.cuda.memory_reserved() / gib,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
    }


class OffloadingWorker:
    """Mixin for a `TrainingWorker` (listed before it in the bases): `offload_to_host` /
    `backload_to_device`, and every method that uses the state (`BACKLOADING_METHODS`,
    `READING_METHODS`) brings it back first."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    settings: Any
    _host_offload: HostOffload | None = None

    def offload_to_host(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Move `parts` of this worker's state to host memory; the figures of the move.

        Nothing moves where FSDP2 already keeps the state in host memory (`fsdp_config.cpu_offload`)
        or before `setup`."""
        parts = _check_parts(parts)
        if self.model is None or getattr(self.settings, "cpu_offload", False):
            return {"offloaded_gib": 0.0, "offload_s": 0.0}
        if self._host_offload is None:
            self._host_offload = HostOffload(self.model, self.optimizer)
        started = time.perf_counter()
        moved = self._host_offload.offload(parts)
        return {
            "offloaded_gib": moved / (1 << 30),
            "offload_s": time.perf_counter() - started,
            **device_memory(),
        }

    def backload_to_device(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Bring `parts` of this worker's state back to its devices; the figures of the move."""
        parts = _check_parts(parts)
        if self._host_offload is None or not self._host_offload.offloaded:
            return {"backloaded_gib": 0.0, "backload_s": 0.0}
        started = time.perf_counter()
        moved = self._host_offload.backload(parts)
        return {"backloaded_gib": moved / (1 << 30), "backload_s": time.perf_counter() - started}

    def offloaded_parts(self) -> list[str]:
        """The parts of the state in host memory now."""
        return list(self._host_offload.offloaded) if self._host_offload is not None else []

    @contextmanager
    def state_on_device(self) -> Iterator[None]:
        """The state on its devices for the block; what was in host memory goes back after it."""
        parts = self._host_offload.offloaded if self._host_offload is not None else ()
        self.backload_to_device(parts)
        try:
            yield
        finally:
            if parts:
                self.offload_to_host(parts)


#: `TrainingWorker` methods that need the whole state on its devices: they bring it back first.
BACKLOADING_METHODS = (
    "compute_logprobs",
    "compute_values",
    "train_mini_batch",
    "accumulate_gradients",
    "optimizer_step",
    "zero_grad",
    "load_checkpoint",
)
#: `TrainingWorker` methods that read the state and leave it where it was (the weights pushed to the
#: engines, a checkpoint or an export while the engines are awake).
READING_METHODS = ("iter_full_weights", "lora_adapter", "save_checkpoint", "export_hf")


def _named(method: Callable[..., Any], name: str, doc: str) -> Callable[..., Any]:
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    return method


def _backloading(name: str) -> Callable[..., Any]:
    def method(self: OffloadingWorker, *args: Any, **kwargs: Any) -> Any:
        self.backload_to_device()
        return getattr(super(OffloadingWorker, self), name)(*args, **kwargs)

    return _named(method, name, f"`TrainingWorker.{name}`, with the state brought back to its devices first.")


def _reading(name: str) -> Callable[..., Any]:
    def method(self: OffloadingWorker, *args: Any, **kwargs: Any) -> Any:
        with self.state_on_device():
            return getattr(super(OffloadingWorker, self), name)(*args, **kwargs)

    def iterator(self: OffloadingWorker, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self.state_on_device():
            yield from getattr(super(OffloadingWorker, self), name)(*args, **kwargs)

    reads = iterator if name == "iter_full_weights" else method
    return _named(
        reads, name, f"`TrainingWorker.{name}` on the state's devices; offloaded parts go back after."
    )


for _name in BACKLOADING_METHODS:
    setattr(OffloadingWorker, _name, _backloading(_name))
for _name in READING_METHODS:
    setattr(OffloadingWorker, _name, _reading(_name))
