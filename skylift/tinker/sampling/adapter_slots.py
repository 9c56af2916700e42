"""The LoRA adapters one sampling engine holds at once, least recently used out first.

An engine started with LoRA keeps up to `capacity` adapters in its workers' cache (vLLM's
`max_cpu_loras`; `max_loras` of them run in one batch). `AdapterSlots` maps sampler tags to the
adapter names loaded in the engine: a request for a loaded tag takes it at once (other users'
generations go on); a new tag is loaded into a free slot, or into the slot of the least recently
used adapter no request is using (evicted: unloaded from the engine; a later request loads it
again from its checkpoint or snapshot). When every slot is in use the request waits for one.

Adapters held in memory (ephemeral snapshots) are written to a scratch directory for vLLM to read,
kept while the adapter holds its slot and deleted when it is evicted: vLLM reads an adapter again
from its path whenever its workers' cache lost it, which every full-weight push into the engine
does (vLLM's ``reset_lora_state`` after a reload; the engine swaps full weights for full
fine-tunes and for requests an adapter cannot serve). Deleted at load, the next request of such
an adapter made the engine process die ("No adapter found"), for every user. At most
`capacity` adapters are on disk at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skylift.tinker.sampling.weights import AdapterSource
from skylift.weight_sync.lora.calls import load_adapter, unload_adapter

logger = logging.getLogger(__name__)


@dataclass
class SlotStats:
    loads: int = 0
    hits: int = 0
    evictions: int = 0
    waits: int = 0
    load_s: list[float] = field(default_factory=list)


class AdapterSlots:
    """Adapter slots of one engine (`engine`: a `LocalVLLMEngine` started with LoRA, or anything
    with its `load_lora_adapter` / `unload_lora_adapter`)."""

    def __init__(self, engine: Any, capacity: int, name: str = "sampling engine") -> None:
        if capacity < 1:
            raise ValueError(f"adapter slots must be >= 1, got {capacity}")
        self.engine, self.capacity, self.name = engine, capacity, name
        self._loaded: OrderedDict[str, str] = OrderedDict()  # tag -> adapter name, LRU first
        self._users: Counter[str] = Counter()  # adapter name -> requests using it
        self._ids = itertools.count(1)
        self._cond = asyncio.Condition()
        self._scratch: Path | None = None
        self._written: dict[str, Path] = {}  # adapter name -> its scratch copy (in-memory adapters)
        self.stats = SlotStats()

    def in_use(self) -> int:
        return len(self._loaded)

    def tags(self) -> list[str]:
        """Loaded tags, least recently used first."""
        return list(self._loaded)

    async def acquire(self, tag: str, adapter: AdapterSource) -> str:
        """The engine's name of `tag`'s adapter, loaded if needed; counts one user until `release`."""
        async with self._cond:
            waited = False
            while tag not in self._loaded and len(self._loaded) >= self.capacity:
                victim = next((t for t, n in self._loaded.items() if self._users[n] == 0), None)
                if victim is not None:
                    await self._evict(victim)
                    break
                if not waited:
                    self.stats.waits += 1
                    waited = True
                await self._cond.wait()  # every slot is generating: wait for a release
            if tag in self._loaded:
                self._loaded.move_to_end(tag)
                self.stats.hits += 1
            else:
                self._loaded[tag] = await self._load(tag, adapter)
            name = self._loaded[tag]
            self._users[name] += 1
            return name

    async def release(self, name: str) -> None:
        async with self._cond:
            self._users[name] -= 1
            if self._users[name] <= 0:
                del self._users[name]
            self._cond.notify_all()

    async def _load(self, tag: str, adapter: AdapterSource) -> str:
        name = f"sampler-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        start = loop.time()
        directory = adapter.directory
        if directory is None:
            directory = self._written[name] = await asyncio.to_thread(self._write, name, adapter)
        try:
            await load_adapter(self.engine, name, str(directory))
        except BaseException:
            self._drop_copy(name)
            raise
        self.stats.loads += 1
        self.stats.load_s.append(loop.time() - start)
        logger.info("%s: LoRA adapter of %s in slot %s (%d of %d in use)", self.name, tag, name,
                    len(self._loaded) + 1, self.capacity)  # fmt: skip
        return name

    def _write(self, name: str, adapter: AdapterSource) -> Path:
        from skylift.weight_sync.lora.adapter import write_adapter_dir

        if adapter.tensors is None or adapter.config is None:
            raise ValueError("an in-memory adapter needs its tensors and config")
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="skylift-sampler-adapters-"))
        return Path(
            write_adapter_dir(str(self._scratch / name), list(adapter.tensors.items()), adapter.config)
        )

    async def _evict(self, tag: str) -> None:
        name = self._loaded.pop(tag)
        try:
            await unload_adapter(self.engine, name)
        finally:
            self._drop_copy(name)
        self.stats.evictions += 1
        logger.info("%s: evicted the LoRA adapter of %s (least recently used)", self.name, tag)

    def _drop_copy(self, name: str) -> None:
        written = self._written.pop(name, None)
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)

    def forget(self) -> None:
        """The engine is gone: nothing is loaded any more."""
        self._loaded.clear()
        self._users.clear()
        self._written.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def report(self) -> dict[str, Any]:
        s = self.stats
        return {
            "slots": self.capacity,
            "in_use": len(self._loaded),
            "loads": s.loads,
            "hits": s.hits,
            "evictions": s.evictions,
            "waits_for_a_slot": s.waits,
            "mean_load_s": round(sum(s.load_s) / len(s.load_s), 4) if s.load_s else None,
        }
