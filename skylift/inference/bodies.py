"""Request bodies of the inference server's routes (pydantic models; unknown fields are 400s)."""

from __future__ import annotations

from typing import Any, Literal

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
    # top-k logprobs are a local-engine feature (the Tinker service); this route returns none, so
    # it accepts only the default
    top_logprobs: int = Field(0, ge=0, le=0)
    ignore_eos: bool = False


class GenerateBody(Body):
    """POST /skylift/generate."""

    prompt_token_ids: list[list[int]]
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    prompt_logprobs: bool = False
    session_id: str | None = None
    #: the LoRA adapter to sample with (None: the server's default adapter, if any; "": the base model)
    lora_name: str | None = None


class InitGroupBody(Body):
    """POST /init_weight_update_communicator: fields of `WeightUpdateGroupSpec`, or of SkyRL's
    `BroadcastInitInfo` (`master_addr`, `override_existing_receiver`, `model_dtype_str`).

    `protocol` says how the trainer built its side of the group and sends: "skylift" (skylift's
    sender: bucketed, handshake) or "skyrl" (SkyRL's `init_custom_process_group`, one tensor per
    update, every dtype `model_dtype_str`). Unset, a body with `model_dtype_str` is SkyRL's.
    """

    master_address: str = Field(min_length=1, validation_alias=AliasChoices("master_address", "master_addr"))
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = DEFAULT_GROUP_NAME
    backend: Literal["gloo", "nccl"] = "gloo"
    override_existing: bool = Field(
        False, validation_alias=AliasChoices("override_existing", "override_existing_receiver")
    )
    timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    model_dtype_str: str | None = None
    protocol: Literal["skylift", "skyrl"] | None = None

    def resolved_protocol(self) -> Literal["skylift", "skyrl"]:
        if self.protocol is not None:
            return self.protocol
        return "skyrl" if self.model_dtype_str is not None else "skylift"


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


class WakeUpBody(Body):
    """POST /wake_up (tags may also come as query parameters). SkyRL 0.3.1 sends `{"tags": 1}`
    when its caller names no tags: a number means every tag, like no tags."""

    tags: list[str] | str | int | None = None

    def tag_list(self) -> list[str] | None:
        if isinstance(self.tags, str):
            return [self.tags]
        return self.tags if isinstance(self.tags, list) and self.tags else None


class ResetPrefixCacheBody(Body):
    """POST /reset_prefix_cache (optional; SkyRL 0.4 sends it)."""

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

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False
    activate: bool = False


class UnloadLoraAdapterBody(Body):
    """POST /v1/unload_lora_adapter (vLLM's fields)."""

    lora_name: str = ""
    lora_int_id: int | None = None


class ReceiveLoraAdapterBody(UpdateWeightsBody):
    """POST /skylift/receive_lora_adapter: the adapter's one bucket plus its name and PEFT config."""

    name: str = Field(min_length=1)
    peft_config: dict[str, Any]
    activate: bool = True
    #: loaded adapters it supersedes: unloaded in the same engine call
    retire: list[str] = Field(default_factory=list)
