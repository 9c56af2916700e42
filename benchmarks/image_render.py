"""Image rendering on the CPU render server: start-up time, memory, latency per image.

Starts `CPURenderServer` (vLLM's GPU-less render launcher) on the tiny Qwen2-VL `--starts` times
and reports time-to-healthy and resident memory; then renders PNG images through
`VisionRenderer` + `RenderServerClient`: one at a time (latency per image, including the
client-side decoding of pixel_values) and `--concurrency` at a time (per-image cost under load).

    bash scripts/loopback.sh .venv/bin/python benchmarks/image_render.py
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import time

import numpy as np
from _servers import set_benchmark_env

from skylift.models import prepare_model
from skylift.tinker.images import check_image
from skylift.tinker.render_server import CPURenderServer, RenderServerClient, process_rss_mb
from skylift.tinker.vision_render import VisionRenderer


def png(seed: int, width: int, height: int) -> bytes:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


async def latencies(
    renderer: VisionRenderer, sizes: list[tuple[int, int]], repeats: int, concurrency: int
) -> None:
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
    for i in range(args.starts):
        server.start()
        pid = server.pid
        assert pid is not None
        print(f"start {i + 1}: healthy after {server.startup_s:.1f} s, RSS {process_rss_mb(pid):.0f} MB")
        if i + 1 < args.starts:
            server.stop()
    try:
        client = RenderServerClient(server.url or "")
        renderer = VisionRenderer(client, model)

        async def run() -> None:
            try:
                await latencies(renderer, [(80, 60), (112, 112), (640, 480)], args.repeats, args.concurrency)
            finally:
                await client.close()

        asyncio.run(run())
        pid = server.pid
        assert pid is not None
        print(f"render server RSS after the renders: {process_rss_mb(pid):.0f} MB")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
