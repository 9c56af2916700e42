"""What the typed JSON request bodies of the Tinker routes share, with this server's limits declared.

Each body is the SDK's own request type (`tinker.types`) where it has one, relaxed where this
server has always been lenient (fields the SDK sends but older clients and tests omit get
defaults; unknown fields are ignored, not refused) and tightened with the limits the server
enforces: ids and names are bounded strings, sequence ids 32-bit, counts and top-k within the
server's caps, tensor shapes bounded before anything is made dense. A body is parsed once, by
`parse_body`, into one of these models (each feature's own in its `bodies` module: `training`,
`sampling`, `checkpoints`, `sessions`; here what they all use and the bodies of no one feature); a violation is a 400 naming the field (see
`skylift.tinker.core.deps`). The models also describe the routes' bodies in the OpenAPI document, so
the limits are published and a fuzzer generates bodies around them.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tinker import types as sdk

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


class ModelBody(_Body):
    """What every operation on a loaded model names (checked for ownership before the rest)."""

    model_id: Id


class RetrieveBody(sdk.FutureRetrieveRequest):
    model_config = _LENIENT
    request_id: Id
