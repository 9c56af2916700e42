"""Fixtures of the integration tests: one in-process vLLM engine for the session.

The HTTP server fixtures (`tiny_server`, `tiny_server_url`, `tiny_server_with_key`) live in
tests/conftest.py, shared with tests/reliability; launching helpers in tests/server_helpers.py.

Run these tests inside a loopback-only network namespace:
    bash scripts/loopback.sh .venv/bin/pytest tests/integration
Outside one (any interface besides `lo`), the server and engine fixtures skip unless
SKYLIFT_TESTS_ALLOW_NETWORK=1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from server_helpers import require_loopback_namespace

T = TypeVar("T")


# --------------------------------------------------------------------------- in-process engine


class EngineLoop:
    """One event loop for the session: AsyncLLM's output handler is bound to the loop it starts in."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 300.0) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


@pytest.fixture()
def loopback_only() -> None:
    """Skip unless running in a loopback-only network namespace (see the module docstring)."""
    require_loopback_namespace()


@pytest.fixture(scope="session")
def loop() -> Iterator[EngineLoop]:
    runner = EngineLoop()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path, loop: EngineLoop) -> Iterator[Any]:
    """One in-process `LocalVLLMEngine` on the tiny model (fp32) for the whole session."""
    from skylift.inference.local import LocalVLLMEngine

    require_loopback_namespace()
    eng = loop.run(
        LocalVLLMEngine.create(
            str(tiny_model_dir),
            max_model_len=512,
            seed=0,
            dtype="float32",
            max_num_seqs=16,
            enable_prefix_caching=True,
            enforce_eager=True,  # no torch.compile warm-up: start-up in seconds, not minutes
        ),
        timeout_s=600.0,
    )
    yield eng
    loop.run(eng.close())
