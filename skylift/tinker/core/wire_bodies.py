"""The protobuf bodies of ``/forward`` and ``/forward_backward`` as typed models.

The SDK sends these routes a `ForwardBackwardRequest` protobuf (`tinker.proto.tinker_public_pb2`);
`ForwardBackwardBody.from_proto` turns the parsed message into the models below, which declare
what this server accepts, as the JSON bodies of `skylift.tinker.core.bodies` do: bounded ids and
names, 32-bit non-negative sequence ids, finite loss-config numbers, supported tensor dtypes,
shapes of at most two non-negative dimensions, byte strings that hold whole values. A violation
is a 400 naming the field (`parse_body`). Sizes that depend on the server (the context length,
the cells a request may densify) are checked by `skylift.tinker.core.wire` before any array is made.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field, model_validator
from tinker.proto import tinker_public_pb2 as pb

from skylift.tinker.core.bodies import MAX_CHUNKS, Id, SeqId, _Body

#: numpy dtype of each protobuf tensor dtype this server reads.
NUMPY_OF_DTYPE = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}
#: Most loss inputs of one datum, loss-config entries, and the longest of their names.
MAX_NAMES, MAX_NAME_CHARS = 64, 256
#: Most provenance spans of one datum.
MAX_SPANS = 1 << 16
#: Longest loss-function name.
MAX_LOSS_CHARS = 128

Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Offset = Annotated[int, Field(ge=0, le=2**63 - 1)]


def whole_values(data: bytes, dtype: np.dtype, what: str) -> None:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{what}: {len(data)} bytes are not a whole number of {dtype.name} values")


class SparseCsrBody(_Body):
    values: bytes = b""
    crow_indices: bytes = b""
    col_indices: bytes = b""


class TensorBody(_Body):
    """A `Tensor`: dense bytes or sparse CSR, [N] or [N, K]."""

    dtype: int
    shape: list[Annotated[int, Field(ge=0)]] = Field(default=[], max_length=2)
    dense: bytes = b""
    sparse_csr: SparseCsrBody | None = None

    @model_validator(mode="after")
    def _whole(self) -> TensorBody:
        dtype = NUMPY_OF_DTYPE.get(self.dtype)
        if dtype is None:
            raise ValueError(f"unsupported tensor dtype {self.dtype} (float32, int64 or int32)")
        csr = self.sparse_csr
        if csr is None:
            whole_values(self.dense, dtype, "dense")
            return self
        whole_values(csr.values, dtype, "sparse values")
        whole_values(csr.crow_indices, np.dtype(np.int64), "sparse crow_indices")
        whole_values(csr.col_indices, np.dtype(np.int64), "sparse col_indices")
        if len(self.shape) != 2:
            raise ValueError(f"a sparse CSR tensor needs a 2-D shape, got {self.shape}")
        return self

    @property
    def numpy_dtype(self) -> np.dtype:
        return NUMPY_OF_DTYPE[self.dtype]


class ChunkBody(_Body):
    """One `model_input` chunk: encoded text (int32 tokens) or an image; any other kind is kept
    and fails its datum's future (`skylift.tinker.core.wire`)."""

    kind: Annotated[str, Field(max_length=32)] | None = None
    tokens: bytes = b""
    data: bytes = b""
    format: Annotated[str, Field(max_length=32)] = ""
    expected_tokens: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _whole(self) -> ChunkBody:
        if self.kind == "encoded_text":
            whole_values(self.tokens, np.dtype("<i4"), "tokens")
        return self


class SpanBody(_Body):
    sampled: bool
    sequence_id: Id = ""
    offset: Offset = 0
    length: Offset = 0


class DatumBody(_Body):
    model_input: list[ChunkBody] = Field(default=[], max_length=MAX_CHUNKS)
    loss_fn_inputs: dict[Name, TensorBody] = Field(default={}, max_length=MAX_NAMES)
    loss_fn_input_spans: list[SpanBody] = Field(default=[], max_length=MAX_SPANS)


class ForwardBackwardBody(_Body):
    """`ForwardBackwardRequest` with this server's limits."""

    model_id: Id
    seq_id: SeqId = 0
    loss_fn: Annotated[str, Field(max_length=MAX_LOSS_CHARS)] = ""
    forward_only: bool = False
    loss_fn_config: dict[Name, float | Annotated[str, Field(max_length=1024)]] = Field(
        default={}, max_length=MAX_NAMES
    )
    data: list[DatumBody] = []

    @classmethod
    def fields_of(cls, msg: pb.ForwardBackwardRequest) -> dict[str, Any]:
        """The fields of a parsed message, as this model reads them (bytes stay bytes)."""
        config: dict[str, Any] = dict(msg.loss_fn_config.items())
        for key, value in msg.loss_fn_config_v2.items():
            config[key] = value.text if value.WhichOneof("value") == "text" else value.number
        return {
            "model_id": msg.model_id,
            "seq_id": msg.seq_id,
            "loss_fn": msg.loss_fn,
            "forward_only": msg.forward_only,
            "loss_fn_config": config,
            "data": [_datum(d) for d in msg.data],
        }


def _tensor(msg: pb.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": int(msg.dtype), "shape": list(msg.shape), "dense": msg.dense}
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        out["sparse_csr"] = {
            "values": csr.values,
            "crow_indices": csr.crow_indices,
            "col_indices": csr.col_indices,
        }
    return out


def _chunk(msg: pb.Chunk) -> dict[str, Any]:
    kind = msg.WhichOneof("chunk")
    if kind == "encoded_text":
        return {"kind": kind, "tokens": msg.encoded_text.tokens}
    if kind == "image":
        image = msg.image
        return {
            "kind": kind,
            "data": image.data,
            "format": image.format,
            "expected_tokens": image.expected_tokens,
        }
    return {"kind": kind}


def _span(msg: pb.ProvenanceSpan) -> dict[str, Any]:
    kind = msg.WhichOneof("span")
    arm = msg.sampled_tokens if kind == "sampled_tokens" else msg.prompt_tokens
    return {
        "sampled": kind == "sampled_tokens",
        "sequence_id": arm.sequence_id,
        "offset": arm.offset,
        "length": arm.length,
    }


def _datum(msg: pb.Datum) -> dict[str, Any]:
    return {
        "model_input": [_chunk(c) for c in msg.model_input],
        "loss_fn_inputs": {name: _tensor(t) for name, t in msg.loss_fn_inputs.items()},
        "loss_fn_input_spans": [_span(s) for s in msg.loss_fn_input_spans],
    }
