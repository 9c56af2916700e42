"""Image chunks: reading and checking (no server), and how they split a model input into parts."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest

from skylift.tinker.core.images import ImageInput, check_image, image_from_json
from skylift.tinker.core.model_input import json_parts
from skylift.tinker.errors import UserError


def _image(fmt: str = "PNG", size: tuple[int, int] = (30, 20)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    pixels = (np.random.RandomState(0).rand(size[1], size[0], 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def test_png_and_jpeg_are_accepted_with_their_format() -> None:
    assert check_image(_image("PNG"), "png", "d").format == "png"
    assert check_image(_image("JPEG"), "jpg", "d").format == "jpeg"
    image = check_image(_image("PNG"), "png", "d", expected_tokens=4)
    assert image.expected_tokens == 4 and image.data_url().startswith("data:image/png;base64,")


@pytest.mark.parametrize(
    ("data", "fmt", "message"),
    [
        (_image("PNG")[:100], "png", "datum 2 chunk 1: cannot decode the png image"),
        (b"not an image at all", "png", "datum 2 chunk 1: cannot decode the png image"),
        (b"", "png", "datum 2 chunk 1: the image is empty"),
        (_image("PNG"), "gif", "datum 2 chunk 1: unknown image format 'gif'"),
        (_image("JPEG"), "png", "datum 2 chunk 1: declared format 'png' but the data is JPEG"),
        (_image("GIF"), "png", "datum 2 chunk 1: declared format 'png' but the data is GIF"),
    ],
)
def test_bad_images_are_user_errors_naming_the_chunk(data: bytes, fmt: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        check_image(data, fmt, "datum 2 chunk 1")


def test_asset_pointers_read_local_paths_and_file_urls(tmp_path: Path) -> None:
    path = tmp_path / "cat image.png"
    path.write_bytes(_image("PNG"))
    roots = [tmp_path.resolve()]
    for location in (str(path), path.as_uri()):
        chunk = {"type": "image_asset_pointer", "location": location, "format": "png"}
        assert image_from_json(chunk, "prompt chunk 0", roots).data == path.read_bytes()
    unreadable = [
        (str(tmp_path / "missing.png"), "cannot read image"),
        (str(tmp_path), "cannot read image"),
        ("https://example.invalid/cat.png", "only local paths and file:// URLs"),
        ("file://otherhost/cat.png", "names a remote host"),
        ("", "needs a location"),
    ]
    for location, message in unreadable:
        chunk = {"type": "image_asset_pointer", "location": location, "format": "png"}
        with pytest.raises(UserError, match=f"prompt chunk 0: .*{message}"):
            image_from_json(chunk, "prompt chunk 0", roots)


def test_json_chunks_split_into_text_and_images() -> None:
    data = _image("PNG")
    chunks = [
        {"type": "encoded_text", "tokens": [1, 2]},
        {"type": "image", "data": base64.b64encode(data).decode(), "format": "png", "expected_tokens": 6},
        {"type": "encoded_text", "tokens": [3]},
    ]
    parts = json_parts(chunks, "prompt")
    assert parts[0] == [1, 2] and parts[2] == [3]
    assert isinstance(parts[1], ImageInput) and parts[1].data == data and parts[1].expected_tokens == 6
    with pytest.raises(UserError, match="prompt chunk 0: image data is not valid base64"):
        json_parts([{"type": "image", "data": "%%%", "format": "png"}], "prompt")
    with pytest.raises(UserError, match="prompt chunk 0: unsupported chunk type 'audio'"):
        json_parts([{"type": "audio"}], "prompt")
