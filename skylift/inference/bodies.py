"""Request bodies of the inference server's routes (pydantic models; unknown fields are 400s).

Every size a client controls has a bound declared here, so that the OpenAPI schema says what the
server accepts (and a fuzzer can aim at the edges). Limits an operator can raise (`SKYLIFT_MAX_N`,
`SKYLIFT_MAX_PROMPTS`, ...) are declared in the schema (`maximum`, `maxItems`) and enforced by the
route, whose 400 names the variable; fixed bounds are enforced here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from skylift.inference.image_wire import MAX_IMAGE_BASE64_CHARS, MAX_IMAGES_PER_PROMPT
from skylift.inference.limits import MAX_N, MAX_NAME_CHARS, MAX_PROMPTS, SEED_MAX, SEED_MIN
from skylift.weight_sync.protocol import DEFAULT_GROUP_NAME, PER_TENSOR, GroupProtocol

#: A short identifier (adapter, group, session, tensor name, address).
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
#: Most stop strings / stop token ids of one request, and the longest stop string.
MAX_STOPS = 64
MAX_STOP_CHARS = 1024
#: Most tensors in one weight bucket and dimensions of one tensor.
MAX_BUCKET_TENSORS = 1 << 16
MAX_DIMS = 8
#: Most tokens in one prompt (the context length is checked by the route).
MAX_PROMPT_TOKENS = 1 << 20


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
    stop: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(None, max_length=MAX_STOPS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOPS)
    #: vLLM's workers seed a torch generator with it: int64 only, as in vLLM's OpenAI protocol
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, json_schema_extra={"maximum": MAX_N})
    logprobs: bool = True
    # top-k logprobs are a local-engine feature (the Tinker service); this route returns none, so
    # it accepts only the default
    top_logprobs: int = Field(0, ge=0, le=0)
    ignore_eos: bool = False
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_STOPS
    )


class GenerateBody(Body):
    """POST /skylift/generate."""

    prompt_token_ids: list[Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS)]] = Field(
        json_schema_extra={"minItems": 1, "maxItems": MAX_PROMPTS}
    )
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    prompt_logprobs: bool = False
    session_id: Name | None = None
    #: the LoRA adapter to sample with (None: the server's default adapter, if any; "": the base model)
    lora_name: Name | None = None
    #: a vision-language model's images, one list per prompt (base64 image files; see
    #: `skylift.inference.image_wire`): each stands for one image token of its prompt, in order
    images: (
        list[
            Annotated[
                list[Annotated[str, Field(max_length=MAX_IMAGE_BASE64_CHARS)]],
                Field(max_length=MAX_IMAGES_PER_PROMPT),
            ]
        ]
        | None
    ) = Field(None, json_schema_extra={"maxItems": MAX_PROMPTS})


class InitGroupBody(Body):
    """POST /init_weight_update_communicator: fields of `WeightUpdateGroupSpec`, under their names or
    the per-tensor protocol's (`master_addr`, `override_existing_receiver`, `model_dtype_str`).

    `protocol` says how the trainer built its side of the group and sends: "skylift" (skylift's
    sender: bucketed, handshake) or the per-tensor protocol, `PER_TENSOR` (torch's group helper,
    one tensor per update, every dtype `model_dtype_str`). Unset, a body with `model_dtype_str` is the
    per-tensor protocol's.
    """

    master_address: str = Field(
        min_length=1,
        max_length=MAX_NAME_CHARS,
        validation_alias=AliasChoices("master_address", "master_addr"),
    )
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=1 << 16)
    world_size: int = Field(ge=2, le=1 << 16)
    group_name: Name = DEFAULT_GROUP_NAME
    backend: Literal["gloo", "nccl"] = "gloo"
    override_existing: bool = Field(
        False, validation_alias=AliasChoices("override_existing", "override_existing_receiver")
    )
    #: how long the rendezvous may take (the engine keeps serving meanwhile)
    timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    model_dtype_str: Name | None = None
    protocol: GroupProtocol | None = None

    def resolved_protocol(self) -> GroupProtocol:
        if self.protocol is not None:
            return self.protocol
        return PER_TENSOR if self.model_dtype_str is not None else "skylift"


class UpdateWeightsBody(Body):
    """POST /update_weights: one bucket (see `WeightBucket` for the wire format)."""

    names: list[Annotated[str, Field(max_length=4 * MAX_NAME_CHARS)]] = Field(max_length=MAX_BUCKET_TENSORS)
    dtypes: list[Name] = Field(max_length=MAX_BUCKET_TENSORS)
    shapes: list[Annotated[list[int], Field(max_length=MAX_DIMS)]] = Field(max_length=MAX_BUCKET_TENSORS)


class WeightTransferUpdateBody(Body):
    """POST /update_weights in vLLM's weight-transfer protocol (GPU only)."""

    update_info: dict[str, Any]


class UpdateWeightBody(Body):
    """POST /update_weight: one tensor."""

    name: Annotated[str, Field(max_length=4 * MAX_NAME_CHARS)]
    dtype: Name
    shape: list[int] = Field(max_length=MAX_DIMS)


class SleepBody(Body):
    """POST /sleep (the level may also come as a query parameter)."""

    level: int = Field(1, ge=1, le=2)


class WakeUpBody(Body):
    """POST /wake_up (tags may also come as query parameters). Some clients send `{"tags": 1}`
    when their caller names no tags: a number means every tag, like no tags."""

    tags: Annotated[list[Name], Field(max_length=MAX_STOPS)] | Name | int | None = None

    def tag_list(self) -> list[str] | None:
        if isinstance(self.tags, str):
            return [self.tags]
        return self.tags if isinstance(self.tags, list) and self.tags else None


class ResetPrefixCacheBody(Body):
    """POST /reset_prefix_cache (optional)."""

    reset_running_requests: bool = False


class PauseBody(Body):
    """POST /skylift/pause: how requests in flight are treated (see `LocalVLLMEngine.pause_generation`)."""

    mode: Literal["keep", "abort"] = "keep"


class ResumeBody(Body):
    """POST /skylift/resume: the policy version tokens sampled from now on are labelled with."""

    policy_version: int | None = Field(None, ge=0)


class LoadLoraAdapterBody(Body):
    """POST /v1/load_lora_adapter (vLLM's fields; `activate` is skylift's: make it the default
    adapter of /skylift/generate)."""

    lora_name: Name = ""
    lora_path: Annotated[str, Field(max_length=4096)] = ""
    load_inplace: bool = False
    activate: bool = False


class UnloadLoraAdapterBody(Body):
    """POST /v1/unload_lora_adapter (vLLM's fields)."""

    lora_name: Name = ""
    lora_int_id: int | None = Field(None, ge=0, le=2**31 - 1)


class ReceiveLoraAdapterBody(UpdateWeightsBody):
    """POST /skylift/receive_lora_adapter: the adapter's one bucket plus its name and PEFT config."""

    name: Name = Field(min_length=1)
    peft_config: dict[str, Any]
    activate: bool = True
    #: loaded adapters it supersedes: unloaded in the same engine call
    retire: list[Name] = Field(default_factory=list, max_length=MAX_STOPS)


class DeltaSyncBody(Body):
    """POST /skylift/delta/fetch and /skylift/delta/load: a published version of checkpoint-delta
    sync (`skylift.weight_sync.protocol.DeltaSyncRequest`)."""

    version: int = Field(ge=1, le=10**8 - 1)
    sync_dir: str = Field(min_length=1, max_length=4096)
    local_checkpoint_dir: str | None = Field(None, min_length=1, max_length=4096)
    download_workers: int = Field(4, ge=1, le=64)
