"""One resident copy of each base model's weights, shared by every LoRA training client of it.

A LoRA client trains its adapter only: the base weights are frozen, read by every forward and
backward pass and never written. `BasePool` loads a base model once (in the training dtype, on
the training device) and gives each LoRA client its own module tree over the *same* parameter
and buffer tensors (`shared_tree`: a deep copy whose memo maps every tensor to itself). The
client's tree is then wrapped by PEFT with its own adapter and optimizer, exactly as a model of
its own would be, so forward passes, gradients, checkpoints and merged exports go through the
same `TrainingWorker` code; only the frozen tensors are shared. Train/eval flags, configs and the
adapters themselves are per tree, so one client's operation never touches another's state.

The pool counts clients per base; the last client's release evicts the base. It logs one line
per load and per eviction; `stats()` feeds the server's stats route. Loads run on the training
thread, stats are read from the event loop: a lock guards the table.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)
MIB = 1024 * 1024


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers."""
    seen: dict[int, int] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def shared_tree(template: torch.nn.Module) -> torch.nn.Module:
    """A new module tree whose parameters and buffers are `template`'s own tensor objects."""
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(template.parameters(), template.buffers())}
    return copy.deepcopy(template, memo)


@dataclass
class ResidentBase:
    """A base model held for its LoRA clients."""

    model_path: str
    dtype: str
    template: torch.nn.Module  # never trained, never wrapped: clients get `shared_tree`s of it
    nbytes: int
    load_s: float
    clients: set[str] = field(default_factory=set)


class BasePool:
    """Base models resident for LoRA clients, keyed by (model path, training dtype)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._bases: dict[tuple[str, str], ResidentBase] = {}
        self._lock = threading.Lock()
        self.loads = 0
        self.evictions = 0

    def acquire(self, client_id: str, model_path: str, dtype: str = "float32") -> torch.nn.Module:
        """A module tree over the resident base (loaded now if it is not), held for `client_id`
        until `release`. Blocking: a load reads the checkpoint."""
        key = (model_path, dtype)
        with self._lock:
            base = self._bases.get(key)
        if base is None:
            base = self._load(model_path, dtype)
            with self._lock:
                base = self._bases.setdefault(key, base)
        tree = shared_tree(base.template)
        with self._lock:
            base.clients.add(client_id)
            if self._bases.get(key) is not base:  # evicted meanwhile: hold it again
                self._bases[key] = base
        return tree

    def _load(self, model_path: str, dtype: str) -> ResidentBase:
        from skylift.worker.distributed import device_for_rank
        from skylift.worker.training_worker import load_pretrained

        started = time.perf_counter()
        template = load_pretrained(model_path, dtype)
        template.requires_grad_(False)  # LoRA clients train their adapters only
        template.to(self.device or device_for_rank(0))
        nbytes = tensor_bytes(template)
        load_s = time.perf_counter() - started
        with self._lock:
            self.loads += 1
        logger.info(
            "base model %s resident for LoRA clients: %.1f MiB of %s weights, loaded in %.1f s",
            model_path,
            nbytes / MIB,
            dtype,
            load_s,
        )
        return ResidentBase(model_path, dtype, template, nbytes, load_s)

    def release(self, client_id: str, model_path: str, dtype: str = "float32") -> None:
        """Drop `client_id`'s hold; the base is evicted when no client holds it."""
        key = (model_path, dtype)
        with self._lock:
            base = self._bases.get(key)
            if base is None or client_id not in base.clients:
                return
            base.clients.discard(client_id)
            if base.clients:
                return
            del self._bases[key]
            self.evictions += 1
        logger.info("base model %s evicted: its last LoRA client (%s) is gone", model_path, client_id)

    def resident(self, model_path: str, dtype: str = "float32") -> ResidentBase | None:
        with self._lock:
            return self._bases.get((model_path, dtype))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            bases = [
                {
                    "model_path": b.model_path,
                    "dtype": b.dtype,
                    "resident_bytes": b.nbytes,
                    "lora_clients": len(b.clients),
                    "load_s": round(b.load_s, 3),
                }
                for b in self._bases.values()
            ]
            return {"resident_base_models": bases, "base_loads": self.loads, "base_evictions": self.evictions}
