"""Patch: vLLM's `AsyncLLM` finaliser stays quiet at interpreter exit.

After `close()`, `AsyncLLM.__del__` may still run during interpreter teardown, when module globals
are already None, and print a spurious TypeError at the end of every run that used an in-process
engine. `install` wraps the finaliser so that its errors are ignored (nothing useful can happen in a
finaliser at exit).

Upstream: no issue filed; vLLM 0.32's `AsyncLLM.__del__` calls `shutdown()` unguarded. Removable
when that finaliser tolerates a half-torn-down interpreter (run `skylift demo` and look for a
TypeError after the last line).
"""

from __future__ import annotations

from typing import Any

from skylift.inference.vllm_patches.versions import guard

NAME = "quiet_teardown"
WRITTEN_FOR = "==0.32.*"


def install() -> None:
    """Wrap `AsyncLLM.__del__` (idempotent); `VllmPatchVersionError` on a vLLM it does not fit."""
    guard(NAME, WRITTEN_FOR)
    from vllm.v1.engine.async_llm import AsyncLLM

    quiet_finaliser(AsyncLLM)


def quiet_finaliser(cls: type) -> None:
    """Make `cls.__del__` ignore errors (idempotent; a class without a finaliser is left alone)."""
    original = cls.__dict__.get("__del__")
    if original is None or getattr(original, "_skylift_quiet", False):
        return

    def __del__(self: Any) -> None:
        try:
            original(self)
        except Exception:  # noqa: BLE001 - nothing useful can happen in a finaliser at exit
            pass

    __del__._skylift_quiet = True  # type: ignore[attr-defined]
    cls.__del__ = __del__  # type: ignore[attr-defined]
