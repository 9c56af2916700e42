"""Protobuf conversion for the routes whose payloads the SDK sends or expects as protobuf.

Requests: `ForwardBackwardRequest` (forward and forward_backward). Results: `ForwardBackwardOutput`
and `SampleResponse`. The schema is the SDK's own (`tinker.proto.tinker_public_pb2`). Token ids are
int32 little-endian bytes, tensors dense bytes or sparse CSR, per-datum outputs a `BatchedTensor`
(concatenated bytes plus n+1 int64 byte offsets). A request is parsed once into the typed models
of `skylift.tinker.core.wire_bodies` (a 400 naming the field), then made dense within the server's
limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from skylift.tinker.core.bodies import parse_body
from skylift.tinker.core.images import ImageInput, image_from_proto
from skylift.tinker.core.provenance import Span
from skylift.tinker.core.wire_bodies import ForwardBackwardBody, TensorBody
from skylift.tinker.errors import UserError


@dataclass
class WireDatum:
    """One training example: input tokens and named per-position loss inputs.

    A datum with image chunks keeps them in `parts` (token lists and images, in order); its
    `tokens`, `pixel_values` and `image_grid_thw` are filled in when it is rendered.
    """

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    parts: list[list[int] | ImageInput] | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    loss_spans: list[Span] | None = None  # provenance of the loss_fn_inputs positions

    @property
    def needs_render(self) -> bool:
        return self.parts is not None and self.pixel_values is None


@dataclass
class ForwardBackwardCall:
    """A decoded `ForwardBackwardRequest`."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[WireDatum]
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    error: UserError | None = None  # a datum could not be rendered: the future fails with it


@dataclass(frozen=True)
class WireLimits:
    """What one `ForwardBackwardRequest` may ask, checked before any tensor is allocated."""

    max_tokens: int = 1 << 16  # tokens of one datum: the longest context this server serves
    max_cells: int = 16 * 1024 * 1024  # loss-input cells of one request, padded (--max-request-cells)

    def too_many_cells(self, where: str, cells: int) -> UserError:
        return UserError(
            f"{where}: {cells} loss-input cells are above this server's limit of {self.max_cells} per "
            "request; send fewer or shorter datums (the operator raises it with --max-request-cells)"
        )


def decode_tensor(
    msg: TensorBody, where: str, max_rows: int | None = None, max_cells: int | None = None
) -> np.ndarray:
    """A validated `TensorBody` as a dense numpy array (sparse CSR entries not listed are 0). Its
    shape is checked before anything is allocated: at most `max_rows` rows (the longest context
    served) and `max_cells` cells. Whether it fits its datum is the loss's check."""
    dtype, shape = msg.numpy_dtype, list(msg.shape)
    if max_rows is not None and shape and shape[0] > max_rows:
        raise UserError(
            f"{where}: shape {shape} has {shape[0]} rows, one per model_input token; the longest "
            f"context served here is {max_rows} tokens"
        )
    cells = int(np.prod(shape, dtype=object)) if shape else 0
    if max_cells is not None and cells > max_cells:
        raise UserError(
            f"{where}: shape {shape} has {cells} cells, above the {max_cells} this request has left "
            "(--max-request-cells)"
        )
    csr = msg.sparse_csr
    if csr is not None:
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if (
            len(crow) != shape[0] + 1
            or len(col) != len(values)
            or crow[0] != 0
            or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)
            or (len(col) and (col.min() < 0 or col.max() >= shape[1]))
        ):
            raise UserError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            lo, hi = int(crow[row]), int(crow[row + 1])
            dense[row, col[lo:hi]] = values[lo:hi]
        return dense
    flat = np.frombuffer(msg.dense, dtype=dtype).copy()
    if shape:
        if int(np.prod(shape)) != flat.size:
            raise UserError(f"{where}: {flat.size} values do not fill shape {shape}")
        return flat.reshape(shape)
    return flat


def decode_forward_backward(body: bytes, limits: WireLimits | None = None) -> ForwardBackwardCall:
    """Parse the protobuf body of `/forward_backward` (blocking: run it in a thread). Sizes are
    checked against `limits` before tensors are made dense."""
    limits = limits or WireLimits()
    budget = limits.max_cells
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise UserError(
            f"forward_backward: the body is not a ForwardBackwardRequest protobuf: {exc}"
        ) from exc
    call = parse_body(ForwardBackwardBody, ForwardBackwardBody.fields_of(msg), "forward_backward")
    data: list[WireDatum] = []
    error: UserError | None = None
    for i, datum in enumerate(call.data):
        parts: list[list[int] | ImageInput] = []
        try:
            for j, chunk in enumerate(datum.model_input):
                if chunk.kind == "encoded_text":
                    parts.append(np.frombuffer(chunk.tokens, dtype="<i4").astype(int).tolist())
                elif chunk.kind == "image":
                    parts.append(
                        image_from_proto(
                            chunk.data, chunk.format, chunk.expected_tokens, f"datum {i} chunk {j}"
                        )
                    )
                else:
                    raise UserError(f"datum {i} chunk {j}: unsupported chunk type {chunk.kind!r}")
        except UserError as exc:
            error = error or exc
            parts = []
        has_image = any(isinstance(p, ImageInput) for p in parts)
        tokens = [] if has_image else [t for p in parts if not isinstance(p, ImageInput) for t in p]
        if len(tokens) > limits.max_tokens:
            raise UserError(
                f"datum {i}: model_input has {len(tokens)} tokens; the longest context served here is "
                f"{limits.max_tokens} tokens"
            )
        inputs = {}
        for name, tensor in datum.loss_fn_inputs.items():
            where = f"datum {i} loss_fn_inputs[{name!r}]"
            inputs[name] = decode_tensor(tensor, where, limits.max_tokens, budget)
            budget -= inputs[name].size
        spans = [
            Span(sampled=s.sampled, sequence_id=s.sequence_id, offset=s.offset, length=s.length)
            for s in datum.loss_fn_input_spans
        ] or None
        data.append(
            WireDatum(tokens=tokens, inputs=inputs, parts=parts if has_image else None, loss_spans=spans)
        )
    longest = max((len(d.tokens) for d in data), default=0)
    widest = max((d.inputs[n].shape[1] for d in data for n in d.inputs if d.inputs[n].ndim == 2), default=1)
    padded = len(data) * longest * max(1, widest)
    if padded > limits.max_cells:  # each loss input of the batch is padded to this many cells
        raise limits.too_many_cells(
            f"forward_backward with {len(data)} datums of up to {longest} tokens", padded
        )
    return ForwardBackwardCall(
        model_id=call.model_id,
        seq_id=call.seq_id,
        loss_fn=call.loss_fn,
        forward_only=call.forward_only,
        data=data,
        loss_fn_config=dict(call.loss_fn_config),
        error=error,
    )


def _batched(arrays: Sequence[np.ndarray], dtype: np.dtype, proto_dtype: int) -> pb.BatchedTensor:
    parts = [np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in arrays]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([p.nbytes for p in parts])
    data = b"".join(p.tobytes() for p in parts)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=proto_dtype, trailing_shape=[])


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]
) -> bytes:
    """`ForwardBackwardOutput` bytes: one float32 field per output name, per datum 1-D arrays."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    names = list(outputs[0].keys()) if outputs else []
    for name in names:
        record.fields[name].CopyFrom(
            _batched([out[name] for out in outputs], np.dtype(np.float32), pb.DTYPE_FLOAT32)
        )
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=dict(metrics))
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


@dataclass
class SampledSequenceData:
    """One sampled continuation."""

    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str  # "stop" | "length"
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sampled token, most likely first


MASK_LOGPROB = -99999.0  # the SDK's filler for empty top-k cells (token id 0)


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = tok, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def encode_sample_response(
    sequences: Sequence[SampledSequenceData],
    prompt_logprobs: Sequence[float] | None,
    topk_prompt: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    target_prompt: np.ndarray | None = None,
    prompt_k: int = 0,
    sample_k: int = 0,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """`SampleResponse` bytes (prompt logprobs float32 with NaN where unscored; top-k matrices
    filled with the SDK's sentinel; target prompt logprobs a dense float32 tensor;
    `prompt_cache_hit_tokens` the prompt's prefix-cache hits, counted once however many samples)."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for seq in sequences:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else pb.STOP_REASON_STOP
        out.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.top_logprobs is not None and sample_k:
            out.topk_sampled_logprobs.CopyFrom(_topk(seq.top_logprobs, sample_k))
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    if topk_prompt is not None and prompt_k:
        msg.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt, prompt_k))
    if target_prompt is not None:
        msg.target_prompt_logprobs.CopyFrom(
            pb.Tensor(
                dense=np.ascontiguousarray(target_prompt, dtype="<f4").tobytes(),
                dtype=pb.DTYPE_FLOAT32,
                shape=list(target_prompt.shape),
            )
        )
    return msg.SerializeToString()
