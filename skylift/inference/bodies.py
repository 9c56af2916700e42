"""Request bodies of the inference server's routes (pydantic models; unknown fields are 400s)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from skylift.weight_sync.protocol import DEFAULT_GROUP_NAME


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsBody(Body):
    """The wire form of `skylift.inference.types.SamplingParams`."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_tokens: int = Field(128, ge=1)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1)
    logprobs: bool = True
    ignore_eos: bool = False


class GenerateBody(Body):
    """POST /skylift/generate."""

    prompt_token_ids: list[list[int]]
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    prompt_logprobs: bool = False
    session_id: str | None = None


class InitGroupBody(Body):
    """POST /init_weight_update_communicator (fields of `WeightUpdateGroupSpec`)."""

    master_address: str = Field(min_length=1, validation_alias=AliasChoices("master_address", "master_addr"))
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = DEFAULT_GROUP_NAME
    backend: Literal["gloo", "nccl"] = "gloo"
    override_existing: bool = False
    timeout_s: float = Field(120.0, gt=0.0, le=3600.0)


class UpdateWeightsBody(Body):
    """POST /update_weights: one bucket (see `WeightBucket` for the wire format)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class UpdateWeightBody(Body):
    """POST /update_weight: one tensor."""

    name: str
    dtype: str
    shape: list[int]


class SleepBody(Body):
    """POST /sleep (the level may also come as a query parameter)."""

    level: int = Field(1, ge=1, le=2)
