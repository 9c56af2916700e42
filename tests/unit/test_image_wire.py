"""Images over /skylift/generate (`skylift.inference.image_wire`, the route's checks): what the
client encodes the server decodes to the same pixels; counts, sizes and formats are refused with a
400 naming the prompt and image before the pixels are decoded, and the server goes on serving."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from test_serve_limits import FakeVllm

from skylift.inference import image_wire, routes
from skylift.inference.image_wire import EncodedImages, ImageWireError, decode_images, encode_images
from skylift.inference.types import Completion, GenerateOutput


def _image(size: tuple[int, int], colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", size, colour)


def _b64(image: Image.Image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return base64.b64encode(out.getvalue()).decode()


def test_encoded_images_decode_to_the_same_pixels_per_prompt() -> None:
    a, b = _image((28, 28), (250, 0, 0)), _image((56, 28), (0, 0, 250))
    wire = encode_images([[a, b], None, []])
    assert [len(p) for p in wire] == [2, 0, 0]
    decoded = decode_images(wire, 3)
    assert decoded[1] is None and decoded[2] is None
    assert [im.tobytes() for im in decoded[0] or []] == [a.tobytes(), b.tobytes()]
    jpeg = decode_images([[_b64(a, "JPEG")]], 1)[0]
    assert jpeg is not None and jpeg[0].size == (28, 28)


@pytest.mark.parametrize(
    "images,prompts,message",
    [
        ([[]], 2, "1 lists for 2 prompts"),
        ([["not base64!"]], 1, "prompt 0 image 0: not base64"),
        ([[base64.b64encode(b"GIF89a but not really").decode()]], 1, "prompt 0 image 0: not an image file"),
    ],
)
def test_bad_images_are_named(images: list[list[str]], prompts: int, message: str) -> None:
    with pytest.raises(ImageWireError, match=message):
        decode_images(images, prompts)


def test_sizes_are_checked_from_the_header_before_the_pixels_are_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big = _b64(Image.new("1", (4097, 4096)))  # 1 bit per pixel: small here, 50 MB as RGB
    loads: list[Any] = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self))
    with pytest.raises(ImageWireError, match=r"prompt 0 image 1: 4097x4096 pixels; at most 16777216"):
        decode_images([[_b64(_image((8, 8), (1, 2, 3))), big]], 1)
    assert loads and not [im for im in loads if im.size == (4097, 4096)]  # only the small one decoded
    monkeypatch.undo()
    monkeypatch.setattr(image_wire, "MAX_REQUEST_IMAGE_PIXELS", 100)
    with pytest.raises(ImageWireError, match="prompt 1 image 0: the request's images exceed 100 pixels"):
        decode_images([[_b64(_image((8, 8), (0, 0, 0)))], [_b64(_image((8, 8), (0, 0, 0)))]], 2)
    tiff = _b64(_image((4, 4), (0, 0, 0)), "TIFF")
    with pytest.raises(ImageWireError, match="not an image file of a format"):
        decode_images([[tiff]], 1)


def test_counts_are_checked_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_wire, "MAX_IMAGES_PER_REQUEST", 3)
    with pytest.raises(ImageWireError, match="4 images in one request; this server takes at most 3"):
        image_wire.check_counts([["x", "x"], ["x", "x"]], 2)
    monkeypatch.setattr(image_wire, "MAX_IMAGE_BASE64_CHARS", 4)
    with pytest.raises(ImageWireError, match="prompt 0 image 0: 5 base64 characters; at most 4"):
        image_wire.check_counts([["xxxxx"]], 1)


class _Engine:
    """Records what the route hands the engine; answers one token per prompt."""

    weight_version = 0

    def __init__(self) -> None:
        self.images: list[Any] = []

    async def generate(
        self, prompts: list[list[int]], params: Any, session_id: Any, **kwargs: Any
    ) -> list[GenerateOutput]:
        self.images.append(kwargs.get("images"))
        return [
            GenerateOutput(prompt_token_ids=p, completions=[Completion([1], [0.0], "length")])
            for p in prompts
        ]


def _client(multimodal: bool) -> tuple[TestClient, _Engine]:
    engine = _Engine()
    state = routes.SkyliftState(
        engine=engine,  # type: ignore[arg-type]
        model_name="tiny-vl",
        model_path="/m",
        max_model_len=256,
        vocab_size=64,
        platform="cpu",
        multimodal=multimodal,
        image_token_id=7,
    )
    app = FastAPI()
    app.state.skylift = state
    app.include_router(routes.router)
    return TestClient(app), engine


def test_the_route_hands_decoded_images_to_the_engine_and_refuses_bad_ones_with_400() -> None:
    client, engine = _client(multimodal=True)
    red = _image((28, 28), (250, 0, 0))
    body = {"prompt_token_ids": [[3, 7], [5]], "sampling_params": {"max_tokens": 2}}
    ok = client.post("/skylift/generate", json={**body, "images": [[_b64(red)], []]})
    assert ok.status_code == 200, ok.text
    sent = engine.images[-1]
    assert sent[1] is None and [im.tobytes() for im in sent[0]] == [red.tobytes()]
    assert client.post("/skylift/generate", json=body).status_code == 200 and engine.images[-1] is None
    bad = {
        "a list per prompt": ([[_b64(red)]], "images: images has 1 lists for 2 prompts"),
        "not base64": ([["%%"], []], "images: prompt 0 image 0: not base64"),
        "too many in one prompt": ([["x"] * 65, []], "at most 64"),
        "an image without its token": (
            [[_b64(red)], [_b64(red)]],
            "prompt 1 has 0 image tokens (id 7) for 1 images",
        ),
    }
    for name, (images, message) in bad.items():
        answer = client.post("/skylift/generate", json={**body, "images": images})
        assert answer.status_code in (400, 422) and message in answer.text, (name, answer.text)
    assert client.post("/skylift/generate", json={**body, "images": [[_b64(red)], []]}).status_code == 200
    text_only, _ = _client(multimodal=False)
    refused = text_only.post("/skylift/generate", json={**body, "images": [[_b64(red)], []]})
    assert refused.status_code == 400 and "the model tiny-vl takes no images" in refused.text


def test_a_server_on_a_vision_language_model_sets_itself_up_for_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skylift.inference import server
    from skylift.inference.engine_args import VISION_ENGINE_ARGS
    from skylift.inference.vllm_patches import qwen2_vl_site

    enabled: list[bool] = []
    monkeypatch.setattr(qwen2_vl_site, "enable", lambda: enabled.append(True))
    vlm, text = tmp_path / "vlm", tmp_path / "text"
    for path, config in ((vlm, {"vision_config": {}}), (text, {"hidden_size": 8})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    args = argparse.Namespace(model=str(vlm), limit_mm_per_prompt={}, mm_device_do_normalize=None)
    assert server.prepare_vision(args) and enabled == [True]
    assert args.limit_mm_per_prompt == VISION_ENGINE_ARGS["limit_mm_per_prompt"]
    assert args.mm_device_do_normalize is False
    mine = argparse.Namespace(model=str(vlm), limit_mm_per_prompt={"image": 2}, mm_device_do_normalize=True)
    server.prepare_vision(mine)  # the flags a user gave stay
    assert (mine.limit_mm_per_prompt, mine.mm_device_do_normalize) == ({"image": 2}, True)
    plain = argparse.Namespace(model=str(text), limit_mm_per_prompt={}, mm_device_do_normalize=None)
    assert not server.prepare_vision(plain) and plain.limit_mm_per_prompt == {} and len(enabled) == 2
    assert not server.prepare_vision(argparse.Namespace(model="org/hub-name"))


def test_the_remote_client_sends_images_that_reach_vllm_through_the_server() -> None:
    """`RemoteInferenceEngine.generate(images=...)` over real HTTP (uvicorn on 127.0.0.1) to the
    routes and `LocalVLLMEngine` (vLLM's AsyncLLM a recorder): vLLM gets the same pixels."""
    import uvicorn

    from skylift.inference.http_session import SessionPool
    from skylift.inference.local import LocalVLLMEngine
    from skylift.inference.remote import RemoteInferenceEngine
    from skylift.inference.types import SamplingParams

    fake = FakeVllm()  # keeps each prompt it is given (`prompts`)
    engine = LocalVLLMEngine(fake, name="fake", tensor_parallel_size=1, sleep_mode_enabled=False)
    app = FastAPI()
    state = routes.SkyliftState(
        engine=engine,
        model_name="m",
        model_path="m",
        max_model_len=64,
        vocab_size=100,
        platform="cpu",
        multimodal=True,
        image_token_id=7,
    )
    routes.install_routes(app, state)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30.0
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    red, blue = _image((28, 28), (250, 0, 0)), _image((56, 28), (0, 0, 250))
    green = _image((28, 56), (0, 250, 0))

    async def go() -> list[Any]:
        pool = SessionPool()  # its own, closed on this loop
        remote = RemoteInferenceEngine(url, session_pool=pool)
        try:
            params = SamplingParams(max_tokens=1, logprobs=False)
            out = await remote.generate([[7, 3, 7], [4]], params, images=[[red, blue], None])
            # a multi-turn rollout's next turn: its images so far (red's pixels in a new object) and
            # the observation's; the client encodes only the new one
            again = [[red.copy(), blue, green]]
            out += await remote.generate([[7, 3, 7, 9, 7]], params, "rollout-1", images=again)
            assert (remote.image_cache.misses, remote.image_cache.hits) == (3, 2)
            return out
        finally:
            await remote.close()
            await pool.close()

    try:
        outputs = asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
    assert [o.prompt_token_ids for o in outputs] == [[7, 3, 7], [4], [7, 3, 7, 9, 7]]
    with_images = [p for p in fake.prompts if p.get("multi_modal_data")]
    assert len(fake.prompts) == 3 and len(with_images) == 2
    sent = [[im.tobytes() for im in p["multi_modal_data"]["image"]] for p in with_images]
    assert sent == [[red.tobytes(), blue.tobytes()], [red.tobytes(), blue.tobytes(), green.tobytes()]]


def test_the_client_encodes_each_image_once_by_its_pixels() -> None:
    cache = EncodedImages()
    red = _image((28, 28), (250, 0, 0))
    first = encode_images([[red, red.copy()], [red]], cache)
    assert first == encode_images([[red, red], [red]])  # the same files as without the cache
    assert (cache.misses, cache.hits) == (1, 2)
    red.paste((0, 250, 0), (0, 0, 28, 28))  # changed in place: encoded afresh, with its new pixels
    (changed,) = encode_images([[red]], cache)[0]
    assert cache.misses == 2 and decode_images([[changed]], 1)[0][0].getpixel((0, 0)) == (0, 250, 0)  # type: ignore[index]
    small = EncodedImages(max_chars=len(changed) + 1)  # room for one file: the older one leaves
    blue = _image((28, 28), (0, 0, 250))
    encode_images([[red, blue, blue, red]], small)
    assert (small.misses, small.hits) == (3, 1)
