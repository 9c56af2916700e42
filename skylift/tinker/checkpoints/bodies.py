"""The typed JSON bodies of the checkpoint routes (see `skylift.tinker.core.bodies`)."""

from __future__ import annotations

from pydantic import Field
from tinker import types as sdk

from skylift.tinker.core.bodies import _LENIENT, Id, SeqId, _Body


class SaveWeightsExternalBody(sdk.SaveWeightsExternalRequest):
    model_config = _LENIENT
    model_id: Id
    path: Id | None = None  # type: ignore[assignment]
    seq_id: SeqId | None = None
    ttl_seconds: float | None = None  # type: ignore[assignment]  (range checked with its message)
    age_encryption_recipients: list[Id] | None = Field(default=None, max_length=64)


class CopyWeightsBody(sdk.CopyWeightsRequest):
    model_config = _LENIENT
    session_id: Id | None = None
    model_seq_id: SeqId | None = None
    destination_project_id: Id | None = None
    source_path: Id = ""
    ttl_seconds: float | None = None  # type: ignore[assignment]  (range checked with its message)


class TtlBody(_Body):
    ttl_seconds: float | None = None


class WeightsInfoBody(_Body):
    tinker_path: Id = ""
