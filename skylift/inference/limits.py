"""Limits of one inference request and timeouts of the engine's control RPCs.

Plain constants (no web framework) so that every transport and the Tinker sampler read the same
values: the HTTP routes, the server's cap on vLLM's own routes and Tinker's sampling checks.
"""

from __future__ import annotations

import os


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError as e:
        raise ValueError(f"{name} must be a number, got {raw!r}") from e


#: Most samples per prompt one request may ask for (`SKYLIFT_MAX_N`).
MAX_N = int(_env_number("SKYLIFT_MAX_N", 256))
#: Most prompts in one /skylift/generate request (`SKYLIFT_MAX_PROMPTS`).
MAX_PROMPTS = int(_env_number("SKYLIFT_MAX_PROMPTS", 4096))
#: Timeout of one weight-bucket receive (`SKYLIFT_WEIGHT_RPC_TIMEOUT_S`).
WEIGHT_RPC_TIMEOUT_S = _env_number("SKYLIFT_WEIGHT_RPC_TIMEOUT_S", 600.0)
#: Timeout of small control RPCs (destroy, has-group).
CONTROL_RPC_TIMEOUT_S = 60.0
