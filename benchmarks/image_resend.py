"""Images re-sent every turn of a multi-turn rollout against a remote engine: the client's cost.

A `/skylift/generate` request is whole (the server keeps no images between requests), so turn k of
a rollout whose every observation carries an image sends k images: a T-turn rollout sends
T(T+1)/2 image files. This benchmark plays the client's side of `--groups` prompts x `--samples`
rollouts of `--turns` turns (a `--size` x `--size` photo-like prompt image, a new one in every
observation), turn by turn, as `RemoteInferenceEngine` encodes them, and the server's decoding of
every request (`image_wire.decode_images`, its checks included).

Baseline, side by side (the two alternate round by round): every image PNG-encoded again for each
request (the client before `EncodedImages`). ratio = the client's encode seconds with the cache /
without it. The bytes on the wire and the server's decoding are the same both ways (reported).

    flock /tmp/skylift-heavy.lock .venv/bin/python benchmarks/image_resend.py
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from PIL import Image

from skylift.inference.image_wire import EncodedImages, decode_images, encode_images


def photo(seed: int, size: int) -> Image.Image:
    """Smooth gradients with noise: compresses like a photo or a rendered frame, not a flat fill."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], -1).astype(np.int16)
    pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def requests(args: argparse.Namespace, round_: int) -> list[list[Any]]:
    """Each request's images (one prompt each), in the order the rollouts send them: turn by turn,
    every rollout of every group (a group's rollouts share their prompt's image object)."""
    seed = round_ * 100_000
    prompts = [photo(seed + g, args.size) for g in range(args.groups)]
    observations = [
        [
            [
                photo(seed + 1000 + (g * args.samples + s) * args.turns + t, args.size)
                for t in range(args.turns - 1)
            ]
            for s in range(args.samples)
        ]
        for g in range(args.groups)
    ]
    out = []
    for turn in range(args.turns):
        for g in range(args.groups):
            for s in range(args.samples):
                out.append([prompts[g], *observations[g][s][:turn]])
    return out


def client_seconds(batch: list[list[Any]], cache: EncodedImages | None) -> tuple[float, list[list[str]]]:
    began = time.perf_counter()
    wire = [encode_images([images], cache)[0] for images in batch]
    return time.perf_counter() - began, wire


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    plain_s = cached_s = decode_s = 0.0
    wire_bytes = files = 0
    for round_ in range(args.rounds):
        batch = requests(args, round_)
        sides = [("plain", None), ("cached", EncodedImages())]
        for name, cache in sides if round_ % 2 == 0 else sides[::-1]:
            seconds, wire = client_seconds(batch, cache)
            if name == "plain":
                plain_s += seconds
                reference = wire
            else:
                cached_s += seconds
                cached_wire = wire
        assert cached_wire == reference, "the cache changed what is sent"
        wire_bytes += sum(len(data) for images in reference for data in images)
        files += sum(len(images) for images in reference)
        began = time.perf_counter()
        for images in reference:
            decode_images([images], 1)
        decode_s += time.perf_counter() - began
    rollouts = args.rounds * args.groups * args.samples
    distinct = args.rounds * args.groups * (1 + args.samples * (args.turns - 1))
    print(
        f"{rollouts} rollouts of {args.turns} turns, {args.size}x{args.size} images: {files} image files sent "
        f"({distinct} distinct), {wire_bytes / rollouts / 2**20:.2f} MiB base64 per rollout"
    )
    print(
        f"client encode: {plain_s / rollouts * 1e3:.0f} ms per rollout without the cache, "
        f"{cached_s / rollouts * 1e3:.0f} ms with it; server decode (checks included): "
        f"{decode_s / rollouts * 1e3:.0f} ms per rollout, both ways"
    )
    print(
        json.dumps(
            {
                "ratio": round(cached_s / plain_s, 3),
                "plain_ms_per_rollout": round(plain_s / rollouts * 1e3, 1),
                "cached_ms_per_rollout": round(cached_s / rollouts * 1e3, 1),
                "server_decode_ms_per_rollout": round(decode_s / rollouts * 1e3, 1),
                "mib_per_rollout": round(wire_bytes / rollouts / 2**20, 2),
                "files_sent": files,
                "distinct_images": distinct,
            }
        )
    )


if __name__ == "__main__":
    main()
