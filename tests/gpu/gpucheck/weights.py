"""Item 3: the weight sender's side of a sync, on the device.

SmolLM2's full weights come out of a `TrainingWorker` (`iter_full_weights`, what `RLWorker.broadcast_weights`
streams), floating tensors are cast to bfloat16 on the device (an engine in bfloat16 fed by a float32
policy), `iter_buckets` cuts them into buckets and `pack_bucket` packs each into flat buffers on the
device, exactly as `WeightSender.send_state_dict` does. A weight-sync group of world size 1 (NCCL on
CUDA, gloo on CPU, on loopback) broadcasts every buffer. The buffers are then copied to CPU and
unpacked there, and must equal the checkpoint's weights cast to bfloat16 on CPU, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from gpucheck.device import Context, synchronize
from gpucheck.report import Item
from skylift.utils.devices import default_backend
from skylift.weight_sync import create_weight_sync_group, iter_buckets, pack_bucket, unpack_bucket
from skylift.weight_sync.process_group import find_free_port
from skylift.worker.training_worker import TrainingWorker, WorkerSettings

BUCKET_MB = 64
ENGINE_DTYPE = torch.bfloat16


def _cast(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, tensor.to(ENGINE_DTYPE) if tensor.is_floating_point() else tensor


def _expected(ctx: Context) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(ctx.smollm2_dir.glob("*.safetensors")):
        state.update(load_file(str(file), device="cpu"))
    return {k: v.to(ENGINE_DTYPE) if v.is_floating_point() else v for k, v in state.items()}


def item_weights(ctx: Context, item: Item) -> None:
    worker = TrainingWorker(WorkerSettings(model_path=str(ctx.smollm2_dir), trainable=False))
    worker.setup()
    backend = default_backend()
    group = create_weight_sync_group(
        master_address="127.0.0.1",
        master_port=find_free_port(),
        rank=0,
        world_size=1,
        group_name="skylift_gpu_check",
        backend=backend,
        timeout_s=60.0,
    )
    try:
        item.figures["group"] = f"{backend}, world size 1, device {group.device}"
        item.holds(
            f"weight-sync group is {backend} on the training device", group.device.type == worker.device.type
        )
        expected = _expected(ctx)
        seen: dict[str, bool] = {}
        buckets: list[dict[str, Any]] = []
        sent = 0
        wrong_dtype: list[str] = []
        off_device: list[str] = []
        weights = _cast(worker.iter_full_weights())
        stream = iter_buckets(weights, BUCKET_MB << 20)
        while True:
            synchronize()
            t0 = time.perf_counter()
            items = next(stream, None)  # the cast to bfloat16 runs here, on the device
            if items is None:
                break
            synchronize()
            t1 = time.perf_counter()
            bucket, buffers = pack_bucket(items, group.device)
            synchronize()
            t2 = time.perf_counter()
            for buf in buffers:
                group.broadcast(buf, src=0)
            synchronize()
            t3 = time.perf_counter()
            off_device += [bucket.names[0] for b in buffers if b.device.type != worker.device.type]
            unpacked = unpack_bucket(bucket, [b.cpu() for b in buffers])
            for (name, tensor), dtype in zip(unpacked, bucket.dtypes, strict=True):
                if dtype != "bfloat16":
                    wrong_dtype.append(name)
                seen[name] = name in expected and torch.equal(tensor, expected[name])
            nbytes = sum(b.numel() * b.element_size() for b in buffers)
            sent += nbytes
            buckets.append(
                {
                    "tensors": len(bucket.names),
                    "MiB": round(nbytes / 2**20, 2),
                    "cast_cut_ms": round((t1 - t0) * 1e3, 2),
                    "pack_ms": round((t2 - t1) * 1e3, 2),
                    "broadcast_ms": round((t3 - t2) * 1e3, 2),
                }
            )
            del buffers, unpacked
        total = sum(b["MiB"] for b in buckets)
        item.figures["buckets"] = buckets
        item.figures["bucket bound MiB"] = BUCKET_MB
        item.figures["total MiB"] = round(total, 1)
        pack_s = sum(b["pack_ms"] for b in buckets) / 1e3
        item.figures["pack GiB/s"] = round(total / 1024 / pack_s, 2) if pack_s > 0 else None
        item.holds("more than one bucket", len(buckets) > 1, f"{len(buckets)} buckets")
        item.holds(
            "every weight sent exactly once",
            sorted(seen) == sorted(expected),
            f"{len(seen)} of {len(expected)}",
        )
        item.holds("unpacked on CPU == the weights cast to bfloat16", all(seen.values()))
        item.holds("every tensor travels as bfloat16", not wrong_dtype, ", ".join(wrong_dtype[:3]))
        item.holds("buffers packed on the training device", not off_device)
        numel = sum(v.numel() for v in expected.values())
        item.holds("bytes sent == 2 x parameters", sent == 2 * numel, f"{sent} bytes for {numel} parameters")
    finally:
        group.destroy()
        worker.shutdown()
