"""A stand-in for the Tinker sampler's `TensorsTransport`, shared by the sampling unit tests."""

from __future__ import annotations

import asyncio

import torch


class FakeTransport:
    """What `EngineHost` and the LoRA calibration call on a `TensorsTransport`: tensors put, then
    pushed (taking `push_s`); counts pushes, and refuses a push with nothing put."""

    def __init__(self, push_s: float = 0.0) -> None:
        self.push_s, self.pushes = push_s, 0
        self.staged: dict[str, torch.Tensor] | None = None

    def put(self, tensors: dict[str, torch.Tensor]) -> None:
        self.staged = tensors

    async def push(self, version: int) -> dict[str, float]:
        assert self.staged is not None  # every push sends tensors put before it
        self.staged = None
        self.pushes += 1
        if self.push_s:
            await asyncio.sleep(self.push_s)
        return {}
