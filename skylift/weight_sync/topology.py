"""Which transport carries full weights to an engine, from where the ranks are.

One rule (`choose_transport`), per engine, from the place of the trainer's sending rank and of
each of the engine's workers (a `Place`: host, device kind, physical GPU):

- an engine worker on the trainer's GPU: CUDA IPC (``ipc``: tensor handles on the same host, the
  workers open and load them). NCCL cannot: NCCL 2.29 refuses two ranks on one GPU ("Duplicate GPU
  detected"), so a tensor-parallel engine with one worker there takes IPC as a whole;
- every worker on another GPU: NCCL broadcast (``nccl``);
- CPU (the trainer's rank or a worker): shared memory (``ipc``: the same handles, in /dev/shm)
  where every worker shares the trainer's host, else gloo broadcast (``gloo``). Under ``auto`` a
  CPU trainer takes shared memory only where /dev/shm holds the weights with room to spare
  (`shared_memory_fits`; a container's default /dev/shm is 64 MB), else gloo.

A host is a kernel and a network namespace (`ipc.place.host_id`): containers with networks of
their own, and the multihost tests' simulated hosts, count as hosts of their own.

`check_forced` refuses, with one line saying why and what to use, a backend the user forced that
cannot work for these places (NCCL with two ranks on one GPU; IPC to another host; NCCL on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from skylift.weight_sync.process_group import WeightSyncError

Transport = Literal["nccl", "gloo", "ipc"]


@dataclass(frozen=True)
class Place:
    """Where one rank runs: its host, "cpu" or "cuda", and (CUDA) the physical GPU's id (a UUID,
    so that two processes with different CUDA_VISIBLE_DEVICES agree)."""

    host: str
    device: Literal["cpu", "cuda"] = "cpu"
    gpu: str | None = None

    def __post_init__(self) -> None:
        if (self.device == "cuda") != (self.gpu is not None):
            raise ValueError(f"a CUDA place names its GPU, a CPU place none: {self}")


def _shares_gpu(a: Place, b: Place) -> bool:
    return a.device == b.device == "cuda" and a.host == b.host and a.gpu == b.gpu


def choose_transport(trainer: Place, workers: Sequence[Place]) -> Transport:
    """The transport for one engine whose workers (one per tensor-parallel rank) are `workers`."""
    if not workers:
        raise ValueError("an engine has at least one worker")
    same_host = all(w.host == trainer.host for w in workers)
    if any(_shares_gpu(trainer, w) for w in workers):
        if not same_host:
            raise WeightSyncError(
                "weight sync: no transport fits an engine with a worker on the trainer's GPU and a worker on "
                "another host (NCCL refuses two ranks on one GPU; CUDA IPC stays on one host): place the "
                "engine's workers on one host"
            )
        return "ipc"
    if trainer.device == "cuda" and all(w.device == "cuda" for w in workers):
        return "nccl"
    return "ipc" if same_host else "gloo"


def choose_transports(trainer: Place, engines: Sequence[Sequence[Place]]) -> list[Transport]:
    """`choose_transport` for each engine (its workers' places)."""
    return [choose_transport(trainer, workers) for workers in engines]


#: /dev/shm room `auto` leaves beside the weights (vLLM's own message queues live there too)
SHM_SPARE_BYTES = 256 << 20


def shared_memory_fits(need: int | None, free: int | None) -> tuple[bool, str]:
    """Whether `auto` may put a CPU trainer's weights (`need` bytes; None: not known before
    gathering) in /dev/shm with `free` bytes (None: not usable) free, and why not."""
    if free is None:
        return False, "/dev/shm is not usable"
    if need is None:
        return False, "the weights' size is not known before gathering"
    if need + SHM_SPARE_BYTES > free:
        return (
            False,
            f"/dev/shm has {free / 2**20:.0f} MiB free, the weights need {need / 2**20:.0f} MiB and room to spare",
        )
    return True, ""


def check_forced(backend: str, trainer: Place, engines: Sequence[Sequence[Place]]) -> None:
    """A `WeightSyncError` of one line when a forced `backend` cannot work for these places."""
    for e, workers in enumerate(engines):
        for w, place in enumerate(workers):
            where = f"engine {e}'s worker {w}"
            if backend == "nccl" and _shares_gpu(trainer, place):
                raise WeightSyncError(
                    f"weight_sync_backend=nccl cannot work: the trainer's rank 0 and {where} share GPU "
                    f'{place.gpu} on {place.host}, and NCCL 2.29 refuses two ranks on one GPU ("Duplicate '
                    'GPU detected"); use weight_sync_backend=auto (CUDA IPC for a same-GPU engine) or ipc'
                )
            if backend == "nccl" and "cpu" in (trainer.device, place.device):
                side = "the trainer's rank 0" if trainer.device == "cpu" else where
                raise WeightSyncError(
                    f"weight_sync_backend=nccl cannot work: {side} runs on CPU and NCCL moves GPU memory "
                    "only; use weight_sync_backend=auto (gloo on CPU), ipc (shared memory on one host) or gloo"
                )
            if backend == "ipc" and place.host != trainer.host:
                raise WeightSyncError(
                    f"weight_sync_backend=ipc cannot work: {where} runs on {place.host}, the trainer on "
                    f"{trainer.host}, and tensor handles stay on one host; use weight_sync_backend=auto "
                    "(NCCL between GPUs, gloo between CPUs) or nccl/gloo"
                )
