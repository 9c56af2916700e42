"""Image chunks: the CPU render server, the pooled render client, and image datums through the SDK.

One render server (vLLM's GPU-less launcher on the tiny Qwen2-VL) and one Tinker server on the
tiny VLM are shared by the module's tests.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import tinker
import torch
from server_helpers import TinkerServer, require_loopback_namespace
from tinker import types

from skylift.models import prepare_model
from skylift.models import tiny_qwen2_vl as vl
from skylift.tinker.core.images import ImageInput, check_image
from skylift.tinker.errors import UserError
from skylift.tinker.vision.render import RenderedInput, VisionRenderer
from skylift.tinker.vision.render_server import CPURenderServer, RenderServerClient

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"
# 80x60 pixels -> smart_resize to 84x56 -> 6x4 patches of 14 -> 2x2 merge: 3x2 = 6 placeholder tokens
WIDTH, HEIGHT, TOKENS = 80, 60, 6


def png(seed: int, width: int = WIDTH, height: int = HEIGHT, fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir() -> Path:
    return prepare_model("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def vlm_tokens(vlm_dir: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vlm_dir)
    return {t: tok.convert_tokens_to_ids(t) for t in vl.VISION_TOKENS}


@pytest.fixture(scope="module")
def render_server(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CPURenderServer]:
    require_loopback_namespace()
    server = CPURenderServer(
        str(vlm_dir), max_model_len=512, log_path=tmp_path_factory.mktemp("render") / "render.log"
    )
    server.start()
    try:
        yield server
    finally:
        pid = server.pid
        server.stop()
        assert pid is not None and not psutil.pid_exists(pid)


def test_render_server_splices_placeholders_and_returns_pixels(
    render_server: CPURenderServer, vlm_dir: Path, vlm_tokens: dict[str, int]
) -> None:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = png(0)
    start, end, pad = vlm_tokens[vl.VISION_START], vlm_tokens[vl.VISION_END], vlm_tokens[vl.IMAGE_PAD]
    parts = [[1, 40, start], check_image(data, "png", "datum 0 chunk 1"), [end, 41]]
    client = RenderServerClient(render_server.url or "")
    renderer = VisionRenderer(client, str(vlm_dir))

    async def render_and_close(parts: list) -> object:
        try:
            return await renderer.render(parts)
        finally:
            await client.close()

    out = asyncio.run(render_and_close(parts))
    assert out.tokens == [1, 40, start] + [pad] * TOKENS + [end, 41]
    assert out.image_grid_thw is not None and out.image_grid_thw.tolist() == [[1, 4, 6]]
    assert out.pixel_values is not None and tuple(out.pixel_values.shape) == (24, 3 * 2 * 14 * 14)
    # the same pixels transformers' own Qwen2-VL image processor computes
    reference = Qwen2VLImageProcessorPil.from_pretrained(vlm_dir)(
        images=[Image.open(io.BytesIO(data))], return_tensors="pt"
    )
    torch.testing.assert_close(out.pixel_values, reference["pixel_values"].float(), atol=1e-5, rtol=0)
    assert reference["image_grid_thw"].tolist() == out.image_grid_thw.tolist()

    # a wrong expected_tokens is the client's mistake, named by the chunk
    wrong = check_image(data, "png", "datum 3 chunk 1", expected_tokens=TOKENS + 1)
    with pytest.raises(UserError, match=r"datum 3 chunk 1: expected_tokens=7 but the image renders to 6"):
        asyncio.run(render_and_close([wrong]))


def test_engine_clients_serve_the_render_route_too(render_server: CPURenderServer, vlm_dir: Path) -> None:
    """An `EnginePool` of remote engines satisfies the same `RenderClient` protocol (pointed here at the
    render server, which serves the route an engine server with --enable-scale-out serves)."""
    from skylift.inference.http_session import SessionPool
    from skylift.inference.pool import EnginePool

    url = render_server.url or ""
    pool = SessionPool()
    engines = VisionRenderer(EnginePool.from_urls([url], session_pool=pool), str(vlm_dir))
    server = VisionRenderer(RenderServerClient(url, pool=pool), str(vlm_dir))
    parts = [[1, 40], check_image(png(4), "png", "datum 0 chunk 1"), [41]]
    garbage = ImageInput(data=b"not a png", format="png", where="datum 5 chunk 0")  # skips check_image

    async def go() -> tuple[RenderedInput, RenderedInput]:
        try:
            via_engines, via_server = await engines.render(parts), await server.render(parts)
            with pytest.raises(UserError, match="datum 5 chunk 0: .*HTTP 400"):
                await engines.render([garbage])
            with pytest.raises(UserError, match="datum 5 chunk 0: .*HTTP 400"):
                await server.render([garbage])
            return via_engines, via_server
        finally:
            await pool.close()

    via_engines, via_server = asyncio.run(go())
    assert via_engines.tokens == via_server.tokens and len(via_engines.tokens) == 3 + TOKENS
    assert via_engines.pixel_values is not None and via_server.pixel_values is not None
    assert torch.equal(via_engines.pixel_values, via_server.pixel_values)


def _connections_to(port: int) -> set[tuple[str, int]]:
    """This process's established connections to `port`, by local address."""
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def test_concurrent_renders_share_one_connection_pool(
    render_server: CPURenderServer, vlm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYLIFT_HTTP_CONNECTION_LIMIT", "2")
    url = render_server.url or ""
    port = int(url.rsplit(":", 1)[1])
    client = RenderServerClient(url)
    assert client.pool.limit == 2 and client.pool.keepalive < 5.0  # below uvicorn's 5 s keep-alive
    renderer = VisionRenderer(client, str(vlm_dir))
    images = [[check_image(png(seed), "png", f"datum {seed} chunk 0")] for seed in range(8)]
    before = _connections_to(port)

    async def batch(close: bool, known: set[tuple[str, int]]) -> tuple[set[tuple[str, int]], object]:
        session = client.pool.get()
        results = await renderer.render_many(images)
        assert len(results) == 8 and all(r.image_grid_thw is not None for r in results)
        assert client.pool.get() is session  # every render of the batch went through one session
        opened = _connections_to(port) - known
        if close:
            await client.close()
        return opened, session

    opened_1, session_1 = asyncio.run(batch(False, before))
    assert 1 <= len(opened_1) <= 2  # 8 concurrent renders over at most 2 pooled connections
    # a new event loop (asyncio.run per batch) gets a rebuilt session (the old one's connections
    # belong to the closed loop); it again opens at most 2
    opened_2, session_2 = asyncio.run(batch(True, before | opened_1))
    assert session_2 is not session_1 and 1 <= len(opened_2) <= 2


# ---------------------------------------------------------------- through the Tinker SDK


@pytest.fixture(scope="module")
def vlm_server(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    require_loopback_namespace()
    tmp = tmp_path_factory.mktemp("tinker-vlm")
    (tmp / "media").mkdir()
    with TinkerServer(
        data_dir=tmp / "data",
        log_path=tmp / "server.log",
        base_model="tiny-qwen2-vl",
        extra_args=["--max-model-len", "512", "--allowed-local-media-path", str(tmp / "media")],
    ) as server:
        yield server


def _status(server: TinkerServer) -> dict:
    import httpx

    return httpx.get(f"{server.url}/skylift/status", headers={"X-API-Key": API_KEY}, timeout=10).json()


def _renderer_status(server: TinkerServer) -> dict:
    renderers = _status(server)["renderers"]
    return renderers[0] if renderers else {"render_server_starts": 0, "render_server_running": False}


def image_datum(vlm_tokens: dict[str, int], data: bytes, fmt: str = "png") -> types.Datum:
    start, end = vlm_tokens[vl.VISION_START], vlm_tokens[vl.VISION_END]
    prefix, suffix = [1, 40, 41, start], [end, 42, 43, 44, 2]
    chunks = [
        types.EncodedTextChunk(tokens=prefix),
        types.ImageChunk(data=data, format=fmt, expected_tokens=TOKENS),
        types.EncodedTextChunk(tokens=suffix),
    ]
    n = len(prefix) + TOKENS + len(suffix)
    targets = np.full(n, 5, dtype=np.int64)
    targets[-len(suffix) :] = [42, 43, 44, 2, 2]
    weights = np.zeros(n, dtype=np.float32)
    weights[-len(suffix) :] = 1.0
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def test_text_only_batch_never_starts_the_render_server(vlm_server: TinkerServer) -> None:
    client = tinker.ServiceClient(base_url=vlm_server.url, api_key=API_KEY)
    tc = client.create_lora_training_client(base_model="tiny-qwen2-vl", rank=4).result()
    tokens = [1, 40, 41, 42, 43, 44, 2]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:]), "weights": np.ones(len(tokens) - 1)},
    )
    out = tc.forward_backward([datum], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
    status = _renderer_status(vlm_server)
    assert status["render_server_starts"] == 0 and not status["render_server_running"]
    client.close("success").result(timeout=60)


def test_image_datum_forward_backward_through_the_sdk(
    vlm_server: TinkerServer, vlm_tokens: dict[str, int], tmp_path: Path
) -> None:
    client = tinker.ServiceClient(base_url=vlm_server.url, api_key=API_KEY)
    tc = client.create_lora_training_client(base_model="tiny-qwen2-vl", rank=4).result()
    datum = image_datum(vlm_tokens, png(1))
    n = datum.model_input.length
    first = tc.forward_backward([datum], "cross_entropy").result()
    logprobs = np.asarray(first.loss_fn_outputs[0]["logprobs"].data)
    assert logprobs.shape == (n,) and np.isfinite(first.metrics["loss:sum"])
    status = _renderer_status(vlm_server)
    assert status["render_server_running"] and status["render_server_starts"] == 1
    pid = status["render_server_pid"]

    # the image reaches the vision tower: another picture changes the text's logprobs after it
    other = tc.forward([image_datum(vlm_tokens, png(2))], "cross_entropy").result()
    assert not np.allclose(np.asarray(other.loss_fn_outputs[0]["logprobs"].data)[-5:], logprobs[-5:])
    # JPEG works too, and training moves the loss
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    jpeg = tc.forward([image_datum(vlm_tokens, png(1, fmt="JPEG"), "jpeg")], "cross_entropy").result()
    assert np.isfinite(jpeg.metrics["loss:sum"])
    again = tc.forward([datum], "cross_entropy").result()
    assert again.metrics["loss:sum"] < first.metrics["loss:sum"]

    # bad images are user errors naming the datum; the server keeps serving
    bad = [
        (image_datum(vlm_tokens, png(1)[:200]), "datum 0 chunk 1: cannot decode the png image"),
        (
            image_datum(vlm_tokens, png(1), "jpeg"),
            "datum 0 chunk 1: declared format 'jpeg' but the data is PNG",
        ),
    ]
    for bad_datum, message in bad:
        with pytest.raises(tinker.RequestFailedError, match=message):
            tc.forward([bad_datum], "cross_entropy").result()
    assert _renderer_status(vlm_server)["render_server_starts"] == 1  # started once

    # releasing the model (its session ends) shuts the render server down
    client.close("success").result(timeout=60)
    deadline = time.monotonic() + 30
    while _renderer_status(vlm_server)["render_server_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _renderer_status(vlm_server)["render_server_running"]
    assert not psutil.pid_exists(pid)
    assert os.environ.get("VLLM_TARGET_DEVICE") is None  # forced in the child only


def test_engine_start_moves_rendering_to_the_engine_and_stops_the_render_server(
    vlm_server: TinkerServer, vlm_tokens: dict[str, int], tmp_path: Path
) -> None:
    client = tinker.ServiceClient(base_url=vlm_server.url, api_key=API_KEY)
    tc = client.create_lora_training_client(base_model="tiny-qwen2-vl", rank=4).result()
    datum = image_datum(vlm_tokens, png(3))
    before = tc.forward([datum], "cross_entropy").result()
    status = _renderer_status(vlm_server)
    assert status["backend"] == "render_server" and status["render_server_running"]
    pid, starts = status["render_server_pid"], status["render_server_starts"]

    # sampling (VLM RL) brings the engine up; a prompt with an image samples through it
    sampler = client.create_sampling_client(base_model="tiny-qwen2-vl").result()
    start, end = vlm_tokens[vl.VISION_START], vlm_tokens[vl.VISION_END]
    prompt = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[1, 40, start]),
            types.ImageChunk(data=png(3), format="png", expected_tokens=TOKENS),
            types.EncodedTextChunk(tokens=[end, 41]),
        ]
    )
    result = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, stop=[], seed=0)).result()
    assert [len(s.tokens) for s in result.sequences] == [4, 4]
    assert all(s.logprobs is not None and np.all(np.isfinite(s.logprobs)) for s in result.sequences)

    # prompts may point at image files (a path or a file:// URL) under the operator's media root
    media = vlm_server.data_dir.parent / "media"
    path = media / "cat.png"
    path.write_bytes(png(3))
    for location in (str(path), path.as_uri()):
        pointer = types.ImageAssetPointerChunk(location=location, format="png", expected_tokens=TOKENS)
        chunks = [prompt.chunks[0], pointer, prompt.chunks[2]]
        out = sampler.sample(
            types.ModelInput(chunks=chunks), 1, types.SamplingParams(max_tokens=2, stop=[])
        ).result()
        assert len(out.sequences[0].tokens) == 2
    missing = types.ImageAssetPointerChunk(
        location=str(media / "nope.png"), format="png", expected_tokens=TOKENS
    )
    with pytest.raises(tinker.RequestFailedError, match="prompt chunk 1: cannot read image"):
        sampler.sample(
            types.ModelInput(chunks=[prompt.chunks[0], missing]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    outside = tmp_path / "cat.png"  # a readable file outside the media root is still refused
    outside.write_bytes(png(3))
    pointer = types.ImageAssetPointerChunk(location=str(outside), format="png", expected_tokens=TOKENS)
    with pytest.raises(tinker.RequestFailedError, match="prompt chunk 1: cannot read image"):
        sampler.sample(
            types.ModelInput(chunks=[prompt.chunks[0], pointer, prompt.chunks[2]]),
            1,
            types.SamplingParams(max_tokens=2),
        ).result()

    # the engine renders now; the CPU render server is gone
    status = _renderer_status(vlm_server)
    assert status["backend"] == "engine" and not status["render_server_running"]
    assert not psutil.pid_exists(pid)
    after = tc.forward([datum], "cross_entropy").result()  # rendered by the engine, same tokens and pixels
    np.testing.assert_allclose(
        np.asarray(after.loss_fn_outputs[0]["logprobs"].data),
        np.asarray(before.loss_fn_outputs[0]["logprobs"].data),
        atol=1e-5,
    )
    assert _renderer_status(vlm_server)["render_server_starts"] == starts  # never restarted
    client.close("success").result(timeout=60)
