"""Item vision: the tiny Qwen2-VL (`skylift models`: one ViT block, 14x14 patches, 2x2 merge, the
tiny-qwen2 text model) trained on rows with images, on the device vs on CPU.

The rows are built as the RL trainer builds them: trajectories whose ids hold one image token per
image (as the chat template renders an image part), expanded and given their `pixel_values` /
`image_grid_thw` by the generator's `VisionInputs.attach` (the model's own image processor), then
`skylift.rl.experience.trajectory_batch` (each row's images in `row_inputs`). Four rows: a prompt
with a 112x56 image sampled twice (the two samples share one processing), a prompt with two 28x28
images and a multi-turn response whose observation carries a 56x28 image (its tokens untrained),
and a text-only row. Item 1's policy step runs on them (fp32 and bf16 mixed precision;
the forward takes the images, the gradient reaches the vision tower), compared with CPU within
item 1's tolerances. The image processor needs Pillow; without it the item is skipped, naming it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from gpucheck.device import Context, peak_label
from gpucheck.models import SEED
from gpucheck.policy import ADVANTAGES, compare, policy_step, reference_step, settings_for
from gpucheck.report import Item, max_abs

MODEL = "tiny-qwen2-vl"
CONFIGS = ("fp32", "bf16-mixed")  # item 1's float32 and trainer.bf16 (bf16 matmuls)
CALIBRATED_BY = {"bf16-mixed": "fp32"}
IMAGE = {"type": "image"}


def missing() -> str | None:
    """None when the image processor can run here, else what is missing."""
    try:
        import PIL  # noqa: F401
    except ImportError as exc:
        return f"the image processor needs Pillow, which this machine lacks ({exc})"
    return None


def vl_dir() -> Path:
    from skylift.models import prepare_model

    return prepare_model(MODEL)


def _image(width: int, height: int, seed: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(SEED + seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def rows(path: Path) -> tuple[Any, dict[str, int]]:
    """The training batch (a `SequenceBatch` with row_inputs and item 1's advantages) and counts."""
    from transformers import AutoTokenizer

    from skylift.generator.trajectory import Trajectory
    from skylift.generator.vision import VisionInputs
    from skylift.rl.experience import trajectory_batch

    tok = AutoTokenizer.from_pretrained(path)
    vision = VisionInputs.load(str(path))
    assert vision is not None

    def render(content: Any, generation: bool = True) -> list[int]:
        messages = [{"role": "user", "content": content}]
        text = tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    wide, small = [_image(112, 56, 1)], [_image(28, 28, 2), _image(28, 28, 3)]
    observation = _image(56, 28, 4)
    look = [IMAGE, {"type": "text", "text": "What is in the picture?"}]
    sampled, answer = ids("It is a square."), ids("A cat.")
    turn_end, next_turn = ids("<|im_end|>\n"), render([IMAGE, {"type": "text", "text": "And now?"}])
    multi = sampled + turn_end + next_turn + answer
    multi_mask = [1] * len(sampled) + [0] * (len(turn_end) + len(next_turn)) + [1] * len(answer)
    specs = [  # (prompt ids, response ids, loss mask, images in order)
        (render(look), sampled, None, wide),
        (render(look), answer, None, wide),  # the same image objects: one processing
        (
            render([IMAGE, IMAGE, {"type": "text", "text": "Compare."}]),
            multi,
            multi_mask,
            [*small, observation],
        ),
        (render("Say a word."), answer, None, []),
    ]
    trajectories = []
    for i, (prompt, response, mask, images) in enumerate(specs):
        tr = Trajectory(
            uid=f"p{i}",
            prompt_ids=prompt,
            response_ids=response,
            loss_mask=mask or [1] * len(response),
            rollout_logprobs=[-1.0] * len(response),
            reward=0.0,
            stop_reason="stop",
        )
        vision.attach(tr, images)
        trajectories.append(tr)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = trajectory_batch(trajectories, pad_token_id=pad).with_extras(advantage=torch.tensor(ADVANTAGES))
    counts = {
        "image tokens": int((batch.input_ids == vision.image_token_id).sum()),
        "images": sum(len(r.get("image_grid_thw", [])) for r in batch.row_inputs or []),
        "patches": sum(int(r["pixel_values"].shape[0]) for r in batch.row_inputs or [] if r),
        "tokens": int(batch.attention_mask.sum()),
    }
    return batch, counts


def reference(ctx: Context) -> dict[str, Any]:
    why = missing()
    if why:
        return {"vision/skipped": why}
    path = vl_dir()
    batch, counts = rows(path)
    refs: dict[str, Any] = {"vision/batch": batch, "vision/counts": counts}
    for config in CONFIGS:
        refs[f"vision/{config}"] = reference_step(path, config, batch, f"vision/{config}")
    return refs


def item_vision(ctx: Context, refs: dict[str, Any], item: Item) -> None:
    why = missing() or refs.get("vision/skipped")
    if why:
        item.skipped = why
        return
    path = vl_dir()
    batch, counts = rows(path)
    ref_batch = refs["vision/batch"]
    item.holds("rows: the same ids as the CPU phase's", torch.equal(batch.input_ids, ref_batch.input_ids))
    item.holds(
        "rows: the same image tensors as the CPU phase's",
        all(
            r.keys() == q.keys() and all(torch.equal(r[k], q[k]) for k in r)
            for r, q in zip(batch.row_inputs or [], ref_batch.row_inputs or [], strict=True)
        ),
    )
    item.holds("rows: 3 of 4 carry images", [bool(r) for r in batch.row_inputs or []] == [True] * 3 + [False])
    item.figures.update({f"batch {k}": v for k, v in counts.items()})
    for config in CONFIGS:
        started = time.perf_counter()
        got = policy_step(settings_for(path, config), batch)
        got.pop("_worker").shutdown()
        cal = refs[f"vision/{CALIBRATED_BY[config]}"] if config in CALIBRATED_BY else None
        tag = f"vision/{config}"
        compare(item, tag, got, refs[tag], cal)
        if cal is not None:  # the calibration itself: bf16 vs fp32, both on CPU
            item.figures[f"{tag} vs float32 on CPU: logprobs max |diff|"] = round(
                max_abs(refs[tag]["lp0"], cal["lp0"]), 6
            )
        tower = [n for n in got["picked_grads"] if "visual." in n]
        item.holds(
            f"{tag}: the images' gradient reaches the vision tower",
            bool(tower) and all(float(got["picked_grads"][n].norm()) > 0 for n in tower),
            ", ".join(tower),
        )
        item.figures[f"{tag} {peak_label()}"] = got["peak_mb"]
        item.figures[f"{tag} device"] = got["device"]
        item.figures[f"{tag} seconds"] = round(time.perf_counter() - started, 2)


__all__ = ["item_vision", "missing", "reference"]
