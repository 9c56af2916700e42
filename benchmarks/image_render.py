"""Image rendering on the CPU render server: start-up time, memory, latency per image.

Starts `CPURenderServer` (vLLM's GPU-less render launcher) on the tiny Qwen2-VL `--starts` times
and reports time-to-healthy and resident memory; then renders PNG images through
`VisionRenderer` + `RenderServerClient`: one at a time (latency per image, including the
client-side decoding of pixel_values) and `--concurrency` at a time (per-image cost under load).

Baseline, side by side: the same images through transformers' Qwen2-VL image processor in this
process (no placeholder splicing, no HTTP). ratio = render-server sequential p50 / in-process
p50 for the 112x112 image: what rendering out of process costs per image.

    bash scripts/loopback.sh .venv/bin/python benchmarks/image_render.py
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time

import numpy as np
from _servers import set_benchmark_env

from skylift.models import prepare_model
from skylift.tinker.core.images import check_image
from skylift.tinker.vision.render import VisionRenderer
from skylift.tinker.vision.render_server import CPURenderServer, RenderServerClient, process_rss_mb


def png(seed: int, width: int, height: int) -> bytes:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def in_process_p50_ms(model: str, width: int, height: int, repeats: int) -> float:
    """Median time of transformers' (PIL) Qwen2-VL image processor on one image, in this process."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(model)
    images = [Image.open(io.BytesIO(png(i, width, height))) for i in range(repeats)]
    processor(images=[images[0]], return_tensors="pt")  # warm-up
    times = []
    for image in images:
        began = time.perf_counter()
        processor(images=[image], return_tensors="pt")
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


async def latencies(
    renderer: VisionRenderer, sizes: list[tuple[int, int]], repeats: int, concurrency: int
) -> dict[str, float]:
    """Sequential p50 (ms) per image size, keyed `WxH`; prints the details."""
    p50: dict[str, float] = {}
    for width, height in sizes:
        images = [check_image(png(i, width, height), "png", f"image {i}") for i in range(repeats)]
        began = time.perf_counter()
        first = await renderer.render_image(images[0])  # warm-up (the very first request is the slowest)
        first_ms = (time.perf_counter() - began) * 1000
        single = []
        for image in images:
            began = time.perf_counter()
            await renderer.render_image(image)
            single.append((time.perf_counter() - began) * 1000)
        began = time.perf_counter()
        for start in range(0, len(images), concurrency):
            await asyncio.gather(*(renderer.render_image(im) for im in images[start : start + concurrency]))
        per_image_loaded = (time.perf_counter() - began) * 1000 / len(images)
        print(
            f"{width}x{height} -> {len(first.tokens)} tokens, pixel_values {tuple(first.pixel_values.shape)}: "
            f"first {first_ms:.1f} ms, "
            f"sequential p50 {statistics.median(single):.1f} ms, p90 {pct(single, 90):.1f} ms "
            f"(n={len(single)}); {concurrency} concurrent: {per_image_loaded:.1f} ms per image"
        )
        p50[f"{width}x{height}"] = statistics.median(single)
    return p50


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    set_benchmark_env()
    model = str(prepare_model("tiny-qwen2-vl"))
    began = time.perf_counter()
    import vllm.entrypoints.scale_out.token_in_token_out.mm_serde  # noqa: F401 - what decoding pixels imports

    print(
        f"client side: importing vLLM's decoder took {time.perf_counter() - began:.1f} s (once per process)"
    )
    server = CPURenderServer(model, max_model_len=512)
    startups: list[float] = []
    for i in range(args.starts):
        server.start()
        pid = server.pid
        assert pid is not None
        startups.append(server.startup_s or 0.0)
        rss_idle = process_rss_mb(pid)
        print(f"start {i + 1}: healthy after {server.startup_s:.1f} s, RSS {rss_idle:.0f} MB")
        if i + 1 < args.starts:
            server.stop()
    try:
        client = RenderServerClient(server.url or "")
        renderer = VisionRenderer(client, model)

        async def run() -> dict[str, float]:
            try:
                sizes = [(80, 60), (112, 112), (640, 480)]
                return await latencies(renderer, sizes, args.repeats, args.concurrency)
            finally:
                await client.close()

        server_p50 = asyncio.run(run())
        pid = server.pid
        assert pid is not None
        rss_after = process_rss_mb(pid)
        print(f"render server RSS after the renders: {rss_after:.0f} MB")
    finally:
        server.stop()
    local_p50 = in_process_p50_ms(model, 112, 112, args.repeats)
    print(f"baseline: transformers' image processor in this process, 112x112: p50 {local_p50:.1f} ms")
    result = {
        "ratio": round(server_p50["112x112"] / local_p50, 2),
        "server_p50_ms": {k: round(v, 1) for k, v in server_p50.items()},
        "in_process_p50_ms_112x112": round(local_p50, 1),
        "startup_s": [round(x, 1) for x in startups],
        "rss_mb_idle": round(rss_idle),
        "rss_mb_after": round(rss_after),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
