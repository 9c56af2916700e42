"""The body of vLLM's ``/inference/v1/generate`` (`skylift serve --enable-scale-out`), checked
before vLLM reads it.

vLLM's own request model (``GenerateRequest`` with a ``SamplingParams`` struct) leaves fields
unbounded that its engine then chokes on (under fuzzing some malformed bodies got a 500). The
models here declare the legal shape of every field vLLM reads, with the bounds skylift applies to
its own ``/skylift/generate``: finite floats in vLLM's ranges, integers within int64 (the
engine's MessagePack transport), bounded lists and strings. `generate_problems` adds what only the
server knows: token ids inside the vocabulary, ``max_tokens`` and prompts inside the context,
``n`` and ``n x max_tokens`` within the server's limits, no multimodal input for a text model.

Keys vLLM does not know are left alone (vLLM ignores them); the body that passes goes to vLLM
byte for byte (`skylift.inference.vllm_patches.generate_guard`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skylift.inference.limits import MAX_N, MAX_REQUEST_TOKENS, SEED_MAX, SEED_MIN

#: An integer the engine's transport carries (int64).
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
#: Most stop strings / bad words / multimodal parts of one request, and the longest string.
MAX_STRINGS = 64
MAX_STRING_CHARS = 1024
#: Most stop token ids one request may name (renderers list a model's end-of-turn tokens).
MAX_STOP_TOKEN_IDS = 1024
#: Longest request id, model name and cache salt.
MAX_ID_CHARS = 1024
#: Most problems one 400 lists.
MAX_LISTED = 5

Str = Annotated[str, Field(max_length=MAX_STRING_CHARS)]


class Lenient(BaseModel):
    """Unknown keys are ignored (as vLLM ignores them); floats must be finite."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RepetitionDetectionBody(Lenient):
    max_pattern_size: Int64 = Field(0, ge=0)
    min_pattern_size: Int64 = Field(0, ge=0)
    min_count: Int64 = Field(0, ge=0)


class VllmSamplingParamsBody(Lenient):
    """The fields of vLLM's ``SamplingParams`` a client may send, with vLLM's ranges."""

    n: Int64 = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    watermarking: bool | None = None
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int64 = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    #: vLLM's workers seed a torch generator with it: outside int64 the worker raises
    seed: Int64 | None = None
    stop: Str | Annotated[list[Str], Field(max_length=MAX_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    max_tokens: Int64 | None = Field(16, ge=1)
    min_tokens: Int64 = Field(0, ge=0)
    logprobs: Int64 | None = Field(None, ge=-1)
    prompt_logprobs: Int64 | None = Field(None, ge=-1)
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: Int64 | None = Field(None, ge=0)
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: vLLM's RequestOutputKind (the route sets its own)
    output_kind: int = Field(0, ge=0, le=2)
    stream_interval: Int64 | None = Field(None, ge=1)
    #: internal to vLLM (set by the engine, not by clients): only the defaults
    skip_clone: Literal[False] = False
    output_text_buffer_length: int = Field(0, ge=0, le=0)
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: Annotated[list[Str], Field(max_length=MAX_STRINGS)] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: Int64 | None = Field(None, ge=-1)
    repetition_detection: RepetitionDetectionBody | None = None
    routed_experts_prompt_start: Int64 = Field(0, ge=0)
    trace_decode_token_ids: list[int] | None = Field(None, min_length=1)


class StreamOptionsBody(Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class VllmGenerateBody(Lenient):
    """The fields of vLLM's ``GenerateRequest``."""

    request_id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    token_ids: list[int] = Field(min_length=1)
    token_offsets: list[tuple[Int64, Int64]] | None = None
    features: dict[str, Any] | None = None
    content_parts: Annotated[list[dict[str, Any]], Field(max_length=MAX_STRINGS)] | None = None
    sampling_params: VllmSamplingParamsBody
    model: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptionsBody | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    priority: Int64 = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class GenerateLimits:
    """What the server knows about its model and its request limits."""

    vocab_size: int
    max_model_len: int
    #: whether the model takes images/audio/video (`features`, `content_parts`)
    multimodal: bool = False
    max_n: int = MAX_N
    max_request_tokens: int = MAX_REQUEST_TOKENS


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a body: the field (dotted path) and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _loc(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _outside_vocab(
    ids: Iterable[int], vocab_size: int, allow: int | None = None
) -> Iterator[tuple[int, int]]:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size and token != allow:
            yield i, token


def _vocab_problems(
    field: str, ids: list[int] | None, vocab_size: int, allow: int | None = None
) -> list[Problem]:
    if ids is None:
        return []
    if len(ids) > vocab_size:
        return [Problem(field, f"{len(ids)} token ids, more than the vocabulary's {vocab_size}")]
    bad = next(_outside_vocab(ids, vocab_size, allow), None)
    if bad is None:
        return []
    where = f"{field}[{bad[0]}]"
    extra = " (or -1, padding)" if allow is not None else ""
    return [Problem(where, f"token id {bad[1]} is outside the vocabulary [0, {vocab_size}){extra}")]


def _context_problems(body: VllmGenerateBody, limits: GenerateLimits) -> list[Problem]:
    sp, ctx = body.sampling_params, limits.max_model_len
    problems: list[Problem] = []
    if len(body.token_ids) >= ctx:
        problems.append(
            Problem(
                "token_ids",
                f"{len(body.token_ids)} prompt tokens leave no room for an answer: max_model_len is {ctx}",
            )
        )
    if sp.max_tokens is not None and sp.max_tokens >= ctx:
        problems.append(
            Problem(
                "sampling_params.max_tokens",
                f"max_tokens={sp.max_tokens} leaves no room for a prompt: max_model_len is {ctx}",
            )
        )
    if sp.min_tokens >= ctx or (sp.max_tokens is not None and sp.min_tokens > sp.max_tokens):
        problems.append(
            Problem(
                "sampling_params.min_tokens",
                f"min_tokens={sp.min_tokens} must be at most max_tokens={sp.max_tokens} and below "
                f"max_model_len={ctx}",
            )
        )
    if sp.trace_decode_token_ids is not None and len(sp.trace_decode_token_ids) >= ctx:
        problems.append(
            Problem(
                "sampling_params.trace_decode_token_ids",
                f"{len(sp.trace_decode_token_ids)} tokens, not below max_model_len={ctx}",
            )
        )
    if sp.routed_experts_prompt_start > len(body.token_ids):
        problems.append(
            Problem(
                "sampling_params.routed_experts_prompt_start",
                f"{sp.routed_experts_prompt_start} is beyond the prompt's {len(body.token_ids)} tokens",
            )
        )
    rows = sp.prompt_logprob_token_ids
    if rows is not None:
        if len(rows) >= ctx:
            problems.append(
                Problem(
                    "sampling_params.prompt_logprob_token_ids",
                    f"{len(rows)} rows, not below max_model_len={ctx}",
                )
            )
        for r, row in enumerate(rows):
            problems += _vocab_problems(
                f"sampling_params.prompt_logprob_token_ids[{r}]", row, limits.vocab_size, -1
            )
            if problems:
                break
    if body.token_offsets is not None and len(body.token_offsets) > len(body.token_ids):
        problems.append(
            Problem("token_offsets", f"{len(body.token_offsets)} offsets for {len(body.token_ids)} token ids")
        )
    return problems


def _limit_problems(sp: VllmSamplingParamsBody, limits: GenerateLimits) -> list[Problem]:
    problems: list[Problem] = []
    if sp.n > limits.max_n:
        problems.append(
            Problem(
                "sampling_params.n",
                f"n={sp.n} is too large; this server allows n <= {limits.max_n} (its SKYLIFT_MAX_N)",
            )
        )
    elif sp.max_tokens is not None and sp.n * sp.max_tokens > limits.max_request_tokens:
        problems.append(
            Problem(
                "sampling_params.max_tokens",
                f"n={sp.n} x max_tokens={sp.max_tokens} = {sp.n * sp.max_tokens} tokens; this server allows "
                f"at most {limits.max_request_tokens} per request (its SKYLIFT_MAX_REQUEST_TOKENS)",
            )
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sp, name)
        if value is not None and value > limits.vocab_size:
            problems.append(
                Problem(
                    f"sampling_params.{name}",
                    f"{value} is more than the vocabulary's {limits.vocab_size} tokens",
                )
            )
    return problems


def check_generate_body(payload: Any, limits: GenerateLimits) -> list[Problem]:
    """What is wrong with `payload` (a parsed JSON body) as a request of vLLM's generate route;
    empty when vLLM may have it."""
    if not isinstance(payload, dict):
        return [Problem("body", f"must be a JSON object, got {type(payload).__name__}")]
    try:
        body = VllmGenerateBody.model_validate(payload)
    except ValidationError as exc:
        return [Problem(_loc(e["loc"]), e["msg"]) for e in exc.errors(include_url=False)]
    sp, vocab = body.sampling_params, limits.vocab_size
    problems = _vocab_problems("token_ids", body.token_ids, vocab)
    problems += _context_problems(body, limits)
    problems += _limit_problems(sp, limits)
    for name in ("stop_token_ids", "logprob_token_ids", "allowed_token_ids", "trace_decode_token_ids"):
        problems += _vocab_problems(f"sampling_params.{name}", getattr(sp, name), vocab)
    if sp.logit_bias is not None:
        problems += _vocab_problems("sampling_params.logit_bias", list(sp.logit_bias), vocab)
    if not limits.multimodal:
        for name in ("features", "content_parts"):
            if getattr(body, name):
                problems.append(Problem(name, "this server's model takes no multimodal input"))
    return problems


def problems_message(problems: list[Problem]) -> str:
    """One line naming the first `MAX_LISTED` problems."""
    listed = "; ".join(str(p) for p in problems[:MAX_LISTED])
    more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
    return f"invalid /inference/v1/generate request: {listed}{more}"
