"""The typed JSON bodies of the sampling routes (see `skylift.tinker.core.bodies`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from tinker import types as sdk

from skylift.inference.limits import MAX_N
from skylift.tinker.core.bodies import (
    _LENIENT,
    MAX_CHUNKS,
    MAX_TARGET_CELLS,
    MAX_TARGET_SHAPE_CELLS,
    MAX_TOPK,
    Id,
    SeqId,
    _Body,
)


class CreateSamplingSessionBody(sdk.CreateSamplingSessionRequest):
    model_config = _LENIENT
    session_id: Id
    sampling_session_seq_id: SeqId = 0
    base_model: Id | None = None
    model_path: Id | None = None


class TargetTensor(_Body):
    """`target_prompt_logprobs`: an int64 [rows, K] tensor, dense or sparse CSR, whose shape is
    bounded here, before any array is made."""

    data: list[int]
    dtype: str = "int64"
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @field_validator("shape", mode="before")
    @classmethod
    def _shape(cls, shape: Any) -> Any:
        good = isinstance(shape, list) and len(shape) == 2
        if shape is not None and not (good and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"target_prompt_logprobs: shape must be [len(prompt) - 1, K], got {shape!r}")
        return shape

    @model_validator(mode="after")
    def _bounded(self) -> TargetTensor:
        shape = self.shape
        if shape is not None:
            if shape[0] * shape[1] > MAX_TARGET_SHAPE_CELLS:
                raise ValueError(
                    f"target_prompt_logprobs: shape {shape} has {shape[0] * shape[1]} cells; this server's "
                    f"cap is {MAX_TARGET_SHAPE_CELLS} (and at most {MAX_TARGET_CELLS} that ask for a token)"
                )
        elif self.sparse_crow_indices is not None:
            raise ValueError("target_prompt_logprobs: a sparse tensor needs its shape")
        if self.sparse_crow_indices is not None and len(self.data) > MAX_TARGET_CELLS:
            raise ValueError(
                f"target_prompt_logprobs asks for {len(self.data)} cells; this server's cap is {MAX_TARGET_CELLS}"
            )
        return self


class PromptBody(_Body):
    """A `ModelInput`: its chunks are read by `skylift.tinker.core.model_input.json_parts` (tokens,
    images, image pointers), each checked there against the server's limits."""

    chunks: list[dict[str, Any]] = Field(default=[], max_length=MAX_CHUNKS)


class SampleBody(_Body):
    """`SampleRequest` with this server's caps."""

    num_samples: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    prompt: PromptBody = PromptBody()
    sampling_params: dict[str, Any] = {}
    base_model: Id | None = None
    model_path: Id | None = None
    sampling_session_id: Id | None = None
    seq_id: SeqId | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int | None = 0
    topk_sample_logprobs: int | None = 0
    target_prompt_logprobs: TargetTensor | None = None
    prompt_alt_tokens_k: Annotated[int, Field(ge=0, le=MAX_TOPK)] | None = 0
    prompt_logprobs_last_n: SeqId | None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"

    @field_validator("topk_prompt_logprobs", "topk_sample_logprobs")
    @classmethod
    def _topk(cls, k: int | None) -> int:
        k = k or 0
        if k < 0:
            raise ValueError(f"must be a non-negative integer, got {k!r}")
        if k > MAX_TOPK:
            raise ValueError(f"{k} is above this server's cap of {MAX_TOPK} logprobs per position")
        return k
