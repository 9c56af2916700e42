"""Named tensors shared with another process on this host by handle, not by copy.

`share_tensors(named)` packs the tensors into one flat buffer per (device, dtype) and returns a
picklable `SharedTensors`: for a CUDA buffer the CUDA IPC handle `torch.multiprocessing`'s tensor
reduction makes (`reduce_tensor`), for a CPU buffer the name of the shared-memory segment it lives
in (`shm_segments`: a file under /dev/shm that any process on the host can map).
`open_shared(handle)` in the other process maps the buffers back and returns views named as given.
One design for both devices: what differs is only how a buffer is rebuilt.

The sender keeps the buffers alive while the handle object lives (`SharedTensors.release()` drops
them); a receiver copies what it needs out of the views before the sender releases. This module
imports torch, the standard library and `shm_segments` only, so a GPU machine with nothing but torch
can run it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from skylift.weight_sync.ipc.shm_segments import check_room, create_segment, open_segment

__all__ = [
    "fits",
    "write_tensors",
    "SharedBuffer",
    "SharedTensors",
    "TensorSpec",
    "handle_from_wire",
    "handle_to_wire",
    "new_shared",
    "open_shared",
    "share_tensors",
    "tensor_slots",
]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place in its buffer (offset and numel in elements of the buffer's dtype)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class SharedBuffer:
    """One flat buffer of one dtype: how another process rebuilds it, and the tensors in it.

    `device`: "cpu" or "cuda"; `gpu_uuid`: the physical GPU a CUDA buffer lives on (the receiver's
    device index for it may differ from the sender's under another CUDA_VISIBLE_DEVICES)."""

    device: str
    dtype: torch.dtype
    numel: int
    rebuild: Callable[..., Any]
    args: tuple[Any, ...]
    tensors: tuple[TensorSpec, ...]
    gpu_uuid: str | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)


@dataclass
class SharedTensors:
    """The picklable handle `share_tensors` returns. Pickled, it carries handles only; the sender's
    copy also holds the buffers themselves, alive until `release()` (or until it is collected)."""

    buffers: tuple[SharedBuffer, ...]
    order: tuple[str, ...] = ()  # the names in the order `share_tensors` got them
    _keep: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)

    @property
    def names(self) -> list[str]:
        return list(self.order)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def release(self) -> None:
        """Drop the sender's reference to the buffers (receivers must have copied out by now)."""
        self._keep.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {"buffers": self.buffers, "order": self.order}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.buffers, self.order = state["buffers"], state["order"]
        self._keep = []


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _new_buffer(
    device: torch.device, dtype: torch.dtype, numel: int
) -> tuple[torch.Tensor, Callable[..., Any], tuple[Any, ...]]:
    """A flat buffer of `numel` elements on `device`, and how another process rebuilds it."""
    if device.type == "cpu":  # born in a /dev/shm file, so nothing is copied to share it
        storage, name = create_segment(max(numel, 1) * _element_size(dtype))
        buf = torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
        return buf, open_segment, (name, storage.nbytes())
    if device.type != "cuda":
        raise ValueError(f"share_tensors: tensors on {device.type} cannot be shared by handle")
    buf = torch.empty(numel, dtype=dtype, device=device)
    rebuild, args = reduce_tensor(buf)
    return buf, rebuild, tuple(args)


def tensor_slots(handle: SharedTensors) -> dict[str, tuple[torch.Tensor, TensorSpec]]:
    """Each tensor's flat buffer and place in it (a handle this process made and still holds)."""
    return {
        spec.name: (flat, spec)
        for buf, flat in zip(handle.buffers, handle._keep, strict=True)
        for spec in buf.tensors
    }


def fits(handle: SharedTensors, named: dict[str, torch.Tensor]) -> bool:
    """Whether `handle` (made and still held by this process) has `named`'s layout: the same
    names in the same order, shapes, dtypes and devices."""
    if tuple(named) != handle.order or len(handle._keep) != len(handle.buffers):
        return False
    places = tensor_slots(handle)
    for name, t in named.items():
        flat, spec = places[name]
        if tuple(t.shape) != spec.shape or t.dtype != flat.dtype or t.device != flat.device:
            return False
    return True


def write_tensors(handle: SharedTensors, named: dict[str, torch.Tensor]) -> None:
    """Copy `named` (some of `handle`'s tensors, layout as `fits` checks) into its buffers."""
    places = tensor_slots(handle)
    with torch.no_grad():
        for name, t in named.items():
            flat, spec = places[name]
            flat[spec.offset : spec.offset + spec.numel].copy_(t.detach().reshape(-1))
    for flat in handle._keep:
        if flat.device.type == "cuda":
            torch.cuda.current_stream(flat.device).synchronize()


def new_shared(
    layout: Sequence[tuple[str, torch.Tensor]], device: torch.device | None = None
) -> SharedTensors:
    """Shared buffers for tensors of `layout`'s names, shapes and dtypes (meta tensors will do:
    nothing is read from them), on `device` (None: each tensor's own), one buffer per device and
    dtype in the order given, nothing written yet: the handle `share_tensors` would return for such
    tensors, to be filled (`write_tensors`). CPU pages are touched only as they are written."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, t in layout:
        groups.setdefault((device if device is not None else t.device, t.dtype), []).append((name, t))
    check_room(
        sum(
            t.numel() * _element_size(dtype)
            for (where, dtype), items in groups.items()
            if where.type == "cpu"
            for _, t in items
        )
    )
    buffers: list[SharedBuffer] = []
    keep: list[torch.Tensor] = []
    for (where, dtype), items in groups.items():
        specs, offset = [], 0
        for name, t in items:
            specs.append(TensorSpec(name, tuple(t.shape), offset, t.numel()))
            offset += t.numel()
        buf, rebuild, args = _new_buffer(where, dtype, offset)
        uuid = (
            _gpu_uuid(where.index if where.index is not None else torch.cuda.current_device())
            if where.type == "cuda"
            else None
        )
        buffers.append(SharedBuffer(where.type, dtype, offset, rebuild, args, tuple(specs), uuid))
        keep.append(buf)
    return SharedTensors(tuple(buffers), tuple(name for name, _ in layout), keep)


def share_tensors(named: dict[str, torch.Tensor], reuse: SharedTensors | None = None) -> SharedTensors:
    """Copy `named` into shared buffers (one per device and dtype, in the order given) and return
    the handle object another process on this host opens with `open_shared`. `reuse`: a handle
    this process made before and has not released; when `named` has its layout, the tensors are
    copied into its buffers and it is returned (same handles: a receiver that keeps them open
    maps nothing new, and no fresh pages are touched)."""
    if reuse is not None and fits(reuse, named):
        write_tensors(reuse, named)
        return reuse
    handle = new_shared(list(named.items()))
    write_tensors(handle, named)  # a CUDA copy lands before another process reads
    return handle


def _local_cuda_index(uuid: str | None) -> int | None:
    """This process's device index of the GPU with `uuid` (None: not visible here / not known)."""
    if uuid is None:
        return None
    for i in range(torch.cuda.device_count()):
        if _gpu_uuid(i) == uuid:
            return i
    return None


def _open_buffer(buf: SharedBuffer) -> torch.Tensor:
    if buf.device == "cpu":
        storage = buf.rebuild(*buf.args)
        return torch.empty(0, dtype=buf.dtype).set_(storage, 0, (buf.numel,), (1,))
    args = list(buf.args)
    index = _local_cuda_index(buf.gpu_uuid)
    if index is None and buf.gpu_uuid is not None:
        raise RuntimeError(f"open_shared: GPU {buf.gpu_uuid} is not visible to this process")
    if index is not None:
        args[6] = index  # reduce_tensor's device slot: this process's index of that GPU
    return buf.rebuild(*args)


def open_shared(handle: SharedTensors) -> dict[str, torch.Tensor]:
    """Views of the shared tensors, named as `share_tensors` got them (no copy: copy out what
    must outlive the sender's `release()`)."""
    out: dict[str, torch.Tensor] = {}
    for buf in handle.buffers:
        flat = _open_buffer(buf)
        for spec in buf.tensors:
            out[spec.name] = flat[spec.offset : spec.offset + spec.numel].view(spec.shape)
    return {name: out[name] for name in handle.order}


# ---- a JSON form of the handle (for HTTP): only these functions and classes are ever named ---------

_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "open_segment": open_segment,
    "rebuild_cuda_tensor": rebuild_cuda_tensor,
}
_CLASSES: dict[str, type] = {
    "Tensor": torch.Tensor,
    "Parameter": torch.nn.Parameter,
    "TypedStorage": torch.storage.TypedStorage,
    "UntypedStorage": torch.UntypedStorage,
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared tensors: {name!r} is no torch dtype")
    return dtype


def _encode(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, type):
        name = next((k for k, v in _CLASSES.items() if v is value), None)
        if name is None:
            raise ValueError(f"shared tensors: cannot name class {value!r}")
        return {"class": name}
    if isinstance(value, tuple | list):  # torch.Size included
        return {"tuple": [_encode(v) for v in value]}
    raise ValueError(f"shared tensors: cannot encode {type(value).__name__}")


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "hex" in value:
        return bytes.fromhex(value["hex"])
    if "dtype" in value:
        return _dtype_of(value["dtype"])
    if "class" in value:
        return _CLASSES[value["class"]]
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    raise ValueError(f"shared tensors: cannot decode {value!r}")


def handle_to_wire(handle: SharedTensors) -> dict[str, Any]:
    """`handle` as JSON-ready values (no pickle: the receiving side names nothing but
    `_FUNCTIONS` and `_CLASSES`)."""
    buffers = []
    for b in handle.buffers:
        rebuild = next(k for k, v in _FUNCTIONS.items() if v is b.rebuild)
        buffers.append(
            {
                "device": b.device,
                "dtype": _dtype_name(b.dtype),
                "numel": b.numel,
                "rebuild": rebuild,
                "args": [_encode(a) for a in b.args],
                "tensors": [[t.name, list(t.shape), t.offset, t.numel] for t in b.tensors],
                "gpu_uuid": b.gpu_uuid,
            }
        )
    return {"buffers": buffers, "order": list(handle.order)}


def handle_from_wire(wire: dict[str, Any]) -> SharedTensors:
    """The handle `handle_to_wire` encoded; `ValueError` (or `KeyError`) for anything else."""
    buffers = []
    for b in wire["buffers"]:
        if b["device"] not in ("cpu", "cuda"):
            raise ValueError(f"shared tensors: device {b['device']!r}")
        buffers.append(
            SharedBuffer(
                device=b["device"],
                dtype=_dtype_of(b["dtype"]),
                numel=int(b["numel"]),
                rebuild=_FUNCTIONS[b["rebuild"]],
                args=tuple(_decode(a) for a in b["args"]),
                tensors=tuple(
                    TensorSpec(str(n), tuple(int(d) for d in s), int(o), int(k))
                    for n, s, o, k in b["tensors"]
                ),
                gpu_uuid=b.get("gpu_uuid"),
            )
        )
    return SharedTensors(tuple(buffers), tuple(str(n) for n in wire["order"]))
