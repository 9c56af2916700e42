"""The typed JSON request bodies of the Tinker routes, with this server's limits declared on them.

Each body is the SDK's own request type (`tinker.types`) where it has one, relaxed where this
server has always been lenient (fields the SDK sends but older clients and tests omit get
defaults; unknown fields are ignored, not refused) and tightened with the limits the server
enforces: ids and names are bounded strings, sequence ids 32-bit, counts and top-k within the
server's caps, tensor shapes bounded before anything is made dense. A body is parsed once, by
`parse_body`, into one of these models; a violation is a 400 naming the field (see
`skylift.tinker.deps`). The models also describe the routes' bodies in the OpenAPI document, so
the limits are published and a fuzzer generates bodies around them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from tinker import types as sdk

from skylift.inference.limits import MAX_N
from skylift.tinker.errors import UserError

#: Sequence ids (model_seq_id, sampling_session_seq_id, seq_id) are 32-bit on the SDK's side.
MAX_SEQ_ID = 2**31 - 1
#: Longest id, path or name a body may carry.
MAX_ID_CHARS = 1024
#: Most tags of a session, and the longest tag.
MAX_TAGS, MAX_TAG_CHARS = 256, 256
#: Largest LoRA rank (0 = full fine-tuning; negative ranks are refused with their own message).
MAX_LORA_RANK = 4096
#: Most top-k logprobs per position (vLLM's default `max_logprobs`, which the engines keep).
MAX_TOPK = 20
#: Most cells ([rows, K]) of a target_prompt_logprobs tensor, checked before it is made dense.
MAX_TARGET_SHAPE_CELLS = 1 << 20
#: Most target_prompt_logprobs cells one request may ask for (each is a one-token engine prefill).
MAX_TARGET_CELLS = 4096
#: Most prompt chunks of one sample request.
MAX_CHUNKS = 4096
#: Longest ttl_seconds (10 years).
MAX_TTL_S = 10 * 365 * 86400

Id = Annotated[str, Field(max_length=MAX_ID_CHARS)]
SeqId = Annotated[int, Field(ge=0, le=MAX_SEQ_ID)]
Ttl = Annotated[float, Field(gt=0, le=MAX_TTL_S, allow_inf_nan=False)]
Metadata = dict[str, Any]
M = TypeVar("M", bound=BaseModel)
_LENIENT = ConfigDict(extra="ignore", frozen=True, protected_namespaces=(), allow_inf_nan=False)


class _Body(BaseModel):
    model_config = _LENIENT


def parse_body(model: type[M], raw: dict[str, Any], where: str) -> M:
    """`raw` (a JSON object) as `model`; a 400 naming each wrong field otherwise."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise UserError(f"{where}: malformed request ({problems(exc)})") from exc


def problems(exc: ValidationError) -> str:
    """The errors of `exc` as `field.path: message; ...` (the first five)."""
    found = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
    return "; ".join(found)


# ------------------------------------------------------------------------------ sessions
class CreateSessionBody(sdk.CreateSessionRequest):
    model_config = _LENIENT
    tags: list[Annotated[str, Field(max_length=MAX_TAG_CHARS)]] = Field(default=[], max_length=MAX_TAGS)
    user_metadata: Metadata | None = None
    sdk_version: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    project_id: Id | None = None
    display_name: Id | None = None


class HeartbeatBody(sdk.SessionHeartbeatRequest):
    model_config = _LENIENT
    session_id: Id


class FinishReason(_Body):
    type: Annotated[str, Field(max_length=64)] = "success"


class FinishSessionBody(_Body):
    reason: FinishReason | None = None


# ------------------------------------------------------------------------------ training
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


class ModelBody(_Body):
    """What every operation on a loaded model names (checked for ownership before the rest)."""

    model_id: Id


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


class SaveWeightsExternalBody(sdk.SaveWeightsExternalRequest):
    model_config = _LENIENT
    model_id: Id
    path: Id | None = None  # type: ignore[assignment]
    seq_id: SeqId | None = None
    ttl_seconds: float | None = None  # type: ignore[assignment]  (range checked with its message)
    age_encryption_recipients: list[Id] | None = Field(default=None, max_length=64)


class LoadWeightsBody(sdk.LoadWeightsRequest):
    model_config = _LENIENT
    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: SeqId = 0  # type: ignore[assignment]
    base_model: Id | None = None
    path: Id = ""
    optimizer: bool = False


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


# ------------------------------------------------------------------------------ sampling
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
    """A `ModelInput`: its chunks are read by `skylift.tinker.rendering.json_parts` (tokens,
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


class RetrieveBody(sdk.FutureRetrieveRequest):
    model_config = _LENIENT
    request_id: Id
