"""Limits of one inference request and timeouts of the server's engine calls.

Plain constants (no web framework) so that every transport and the Tinker sampler read the same
values: the HTTP routes, the server's cap on vLLM's own routes and Tinker's sampling checks.
"""

from __future__ import annotations

from skylift.config.services import InferenceServerLimits

#: This process's limits (the defaults, or the SKYLIFT_* variables of `InferenceServerLimits`).
LIMITS = InferenceServerLimits.from_env()
#: Most samples per prompt one request may ask for (`SKYLIFT_MAX_N`).
MAX_N = LIMITS.max_n
#: Most prompts in one /skylift/generate request (`SKYLIFT_MAX_PROMPTS`).
MAX_PROMPTS = LIMITS.max_prompts
#: Most sequences (prompts x n) in one /skylift/generate request (`SKYLIFT_MAX_SEQUENCES`).
MAX_SEQUENCES = LIMITS.max_sequences
#: Most tokens one /skylift/generate request may ask to sample, prompts x n x max_tokens
#: (`SKYLIFT_MAX_REQUEST_TOKENS`).
MAX_REQUEST_TOKENS = LIMITS.max_request_tokens
#: Largest body of vLLM's /inference/v1/generate, in bytes (`SKYLIFT_MAX_GENERATE_BODY_MB`).
MAX_GENERATE_BODY_BYTES = int(LIMITS.max_generate_body_mb * (1 << 20))
#: Timeout of one weight-bucket receive (`SKYLIFT_WEIGHT_RPC_TIMEOUT_S`).
WEIGHT_RPC_TIMEOUT_S = LIMITS.weight_rpc_timeout_s
#: Timeout of small control RPCs (destroy, has-group).
CONTROL_RPC_TIMEOUT_S = LIMITS.control_rpc_timeout_s
#: Timeout of one /skylift/generate request inside the server (clients have their own).
SERVER_GENERATE_TIMEOUT_S = 3600.0
#: The seeds vLLM's workers accept (torch's int64 generator seed; vLLM's OpenAI protocol bounds
#: `seed` the same way): any other seed makes the worker raise, which kills the engine core.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
#: Longest weight-update group name, address and other short strings of control bodies.
MAX_NAME_CHARS = 256
