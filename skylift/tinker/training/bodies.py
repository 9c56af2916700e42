"""The typed JSON bodies of the training routes (see `skylift.tinker.core.bodies`)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field
from tinker import types as sdk

from skylift.tinker.core.bodies import _LENIENT, MAX_LORA_RANK, Id, Metadata, SeqId, Ttl, _Body


class LoraBody(sdk.LoraConfig):
    model_config = _LENIENT
    rank: Annotated[int, Field(ge=-MAX_LORA_RANK, le=MAX_LORA_RANK)] = 0
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None


class OptimizerBody(_Body):
    type: Annotated[str, Field(max_length=64)] = "adamw"


class CreateModelBody(sdk.CreateModelRequest):
    model_config = _LENIENT
    session_id: Id
    model_seq_id: SeqId = 0
    base_model: Id | None = None
    user_metadata: Metadata | None = None
    lora_config: LoraBody | None = None
    optimizer_config: OptimizerBody | None = None  # type: ignore[assignment]


class GetInfoBody(sdk.GetInfoRequest):
    model_config = _LENIENT
    model_id: Id


class AdamBody(_Body):
    type: Annotated[str, Field(max_length=64)] = "adamw"
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepBody(_Body):
    """`OptimStepRequest` (its `optim_params` under either wire name)."""

    model_id: Id
    seq_id: SeqId | None = None
    adam_params: AdamBody | None = None
    optimizer_params: AdamBody | None = None

    def params(self) -> dict[str, Any]:
        chosen = self.adam_params or self.optimizer_params or AdamBody()
        return chosen.model_dump(exclude_unset=True)


class SaveWeightsBody(sdk.SaveWeightsRequest):
    model_config = _LENIENT
    model_id: Id
    path: Id | None = None
    seq_id: SeqId | None = None
    ttl_seconds: Ttl | None = None  # type: ignore[assignment]
    user_metadata: Metadata | None = None  # type: ignore[assignment]


class SaveWeightsForSamplerBody(sdk.SaveWeightsForSamplerRequest):
    model_config = _LENIENT
    model_id: Id
    path: Id | None = None
    sampling_session_seq_id: SeqId | None = None
    seq_id: SeqId | None = None
    ttl_seconds: Ttl | None = None  # type: ignore[assignment]
    user_metadata: Metadata | None = None  # type: ignore[assignment]


class LoadWeightsBody(sdk.LoadWeightsRequest):
    model_config = _LENIENT
    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: SeqId = 0  # type: ignore[assignment]
    base_model: Id | None = None
    path: Id = ""
    optimizer: bool = False
