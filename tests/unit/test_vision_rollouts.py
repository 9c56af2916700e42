"""Images in RL rollouts, with fake engines: dataset rows with images (an ``images`` column with
``<image>`` placeholders, or chat-content image parts), the generator's image tokens expanded as
the model sees them, the images' tensors repeated for every sample of a prompt and gathered
across the turns of a multi-turn rollout, and the training batch's rows holding exactly the
images their image tokens stand for.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from skylift.data import DataFileError, PromptDataset
from skylift.envs import Environment, StepResult, register_env
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.rollout_errors import rollout_input
from skylift.generator.vision import VisionError, VisionInputs
from skylift.inference.types import Completion, GenerateOutput, SamplingParams
from skylift.models import tiny_qwen2_vl
from skylift.rl.experience import trajectory_batch
from skylift.worker.vision_inputs import banned_token_ids, check_rows, vision_kwargs, with_sampling_bias

SINGLE = "test_vision_single"
MULTI = "test_vision_multi"


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


@register_env(SINGLE, override=True)
class OneStep(Environment):
    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=1.0, done=True)


@register_env(MULTI, override=True)
class ImageObservation(Environment):
    """Turn 1 is answered with an image (56x28: 2 image tokens); turn 2 ends the rollout."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        if self.turns == 1:
            parts = [
                {"type": "text", "text": "look:"},
                {"type": "image", "image": _png((56, 28), (0, 0, 255))},
            ]
            return StepResult(observations=[{"role": "user", "content": parts}], reward=0.25, done=False)
        self.done = True
        return StepResult(observations=[], reward=1.0, done=True)


class FakeVisionEngine:
    """Answers like vLLM with images: every image token of the prompt expanded with the model's
    image processor, the sampled ids scripted; records the images of every request."""

    def __init__(self, vision: VisionInputs, reply: list[int]) -> None:
        self.vision = vision
        self.reply = reply
        self.calls: list[tuple[list[int], list[Any]]] = []

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        session_id: str | None = None,
        *,
        images: list[list[Any]] | None = None,
    ) -> list[GenerateOutput]:
        assert params.logit_bias == self.vision.logit_bias()  # image tokens are never sampled
        outputs = []
        for i, prompt in enumerate(prompts):
            pictures = list(images[i]) if images is not None else []
            self.calls.append((list(prompt), pictures))
            counts = iter(self.vision.process(pictures)[1]) if pictures else iter(())
            expanded = [
                t
                for tok in prompt
                for t in [tok] * (next(counts) if tok == self.vision.image_token_id else 1)
            ]
            done = Completion(
                token_ids=list(self.reply), logprobs=[-0.5] * len(self.reply), stop_reason="stop"
            )
            outputs.append(GenerateOutput(prompt_token_ids=expanded, completions=[done] * params.n))
        return outputs


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_qwen2_vl.build_tokenizer()


@pytest.fixture
def vision(tokenizer: Any) -> VisionInputs:
    config = tiny_qwen2_vl.build_config(tokenizer)
    return VisionInputs(
        image_processor=tiny_qwen2_vl.build_image_processor(),
        image_token_id=config.image_token_id,
        merge_size=tiny_qwen2_vl.MERGE_SIZE,
        banned_tokens=(config.image_token_id, config.video_token_id, config.vision_start_token_id),
    )


def _write(path: Any, rows: list[dict[str, Any]]) -> Any:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _row(prompt: Any, images: list[Any] | None = None) -> dict[str, Any]:
    row = {"data_source": "geo", "prompt": prompt, "env_class": SINGLE}
    if images is not None:
        row["images"] = images
    return row


def test_images_column_with_placeholders_becomes_image_parts(tmp_path: Any) -> None:
    red, green = _png((28, 28), (255, 0, 0)), _png((56, 56), (0, 255, 0))
    rows = [
        _row(
            [{"role": "user", "content": "<image>What is x?<image>"}],
            [{"bytes": red, "path": None}, {"bytes": green, "path": None}],
        ),
        _row(
            [{"role": "user", "content": "Find y."}], [{"bytes": red, "path": None}]
        ),  # no placeholder: first
        _row([{"role": "user", "content": "text only"}], []),
    ]
    data = PromptDataset(_write(tmp_path / "geo.parquet", rows))
    parts = data[0].prompt[0]["content"]
    assert [p["type"] for p in parts] == ["image", "text", "image"]
    assert parts[0]["image"].size == (28, 28) and parts[2]["image"].size == (56, 56)
    assert [p["type"] for p in data[1].prompt[0]["content"]] == ["image", "text"]
    assert data[2].prompt == [{"role": "user", "content": "text only"}]
    assert "images" not in data[0].columns


def test_chat_content_image_parts_and_paths_are_read(tmp_path: Any) -> None:
    picture = tmp_path / "p.png"
    picture.write_bytes(_png((28, 28), (1, 2, 3)))
    content = [
        {"type": "image", "image": str(picture), "text": None},
        {"type": "text", "image": None, "text": "Area?"},
    ]
    data = PromptDataset(_write(tmp_path / "parts.parquet", [_row([{"role": "user", "content": content}])]))
    parts = data[0].prompt[0]["content"]
    assert parts[0]["image"].size == (28, 28) and parts[1] == {"type": "text", "text": "Area?"}


@pytest.mark.parametrize(
    "prompt,images,message",
    [
        ("<image><image>two?", 1, "more <image> placeholders than images"),
        ("<image>one?", 2, "2 image(s) but 1 <image> placeholder(s)"),
    ],
)
def test_placeholders_and_images_that_do_not_match_are_refused(
    tmp_path: Any, prompt: str, images: int, message: str
) -> None:
    pictures = [{"bytes": _png((28, 28), (9, 9, 9)), "path": None}] * images
    path = _write(tmp_path / "bad.parquet", [_row([{"role": "user", "content": prompt}], pictures)])
    with pytest.raises(DataFileError, match="row 0") as info:
        PromptDataset(path)
    assert message in str(info.value)


def test_an_undecodable_image_is_refused_naming_the_row(tmp_path: Any) -> None:
    path = _write(
        tmp_path / "bad.parquet",
        [_row([{"role": "user", "content": "<image>?"}], [{"bytes": b"nope", "path": None}])],
    )
    with pytest.raises(DataFileError, match="row 0 image 0: not a decodable image"):
        PromptDataset(path)


def _image_rows(tmp_path: Any, env_class: str) -> PromptDataset:
    big, small = _png((112, 56), (200, 0, 0)), _png((28, 28), (0, 200, 0))
    rows = [
        {
            **_row([{"role": "user", "content": "<image>first"}], [{"bytes": big, "path": None}]),
            "env_class": env_class,
        },
        {
            **_row([{"role": "user", "content": "<image>and<image>"}], [{"bytes": small, "path": None}] * 2),
            "env_class": env_class,
        },
    ]
    return PromptDataset(_write(tmp_path / "rows.parquet", rows))


def _row_tokens(batch: Any, row: int, token: int) -> int:
    return int((batch.input_ids[row] == token).sum())


def test_images_are_repeated_for_every_sample_of_a_prompt(
    tmp_path: Any, tokenizer: Any, vision: VisionInputs
) -> None:
    data = _image_rows(tmp_path, SINGLE)
    engine = FakeVisionEngine(vision, tokenizer.encode("ok", add_special_tokens=False))
    generator = Generator(engine, tokenizer, GeneratorSettings(default_env_class=SINGLE), vision=vision)
    out = asyncio.run(generator.generate(list(data), 3, SamplingParams(max_tokens=4)))
    assert len(out) == 6 and [len(images) for _, images in engine.calls] == [1, 2]
    # 112x56 -> grid 1x4x8 (t, h, w) -> 8 tokens; 28x28 -> grid 1x2x2 -> 1 token each
    for tr in out[:3]:
        assert tr.prompt_ids.count(vision.image_token_id) == 8
        assert tr.vision_inputs is not None and tr.vision_inputs["image_grid_thw"].tolist() == [[1, 4, 8]]
        assert tr.prompt_ids == out[0].prompt_ids and not tr.images
    for tr in out[3:]:
        assert tr.prompt_ids.count(vision.image_token_id) == 2
        assert tr.vision_inputs is not None and tr.vision_inputs["image_grid_thw"].tolist() == [[1, 2, 2]] * 2
    batch = trajectory_batch(out, pad_token_id=0)
    assert batch.row_inputs is not None and len(batch.row_inputs) == 6
    model = torch.nn.Module()
    model.config = tiny_qwen2_vl.build_config(tokenizer)  # type: ignore[assignment]
    kwargs = vision_kwargs(model, batch)  # every row's images, in row order
    assert kwargs["image_grid_thw"].tolist() == [[1, 4, 8]] * 3 + [[1, 2, 2]] * 6
    assert kwargs["pixel_values"].shape[0] == int(kwargs["image_grid_thw"].prod(-1).sum())
    assert int(kwargs["mm_token_type_ids"].sum()) == 3 * 8 + 3 * 2
    # a micro-batch of rows 1 and 4 keeps their own images
    micro = batch.select([4, 1])
    assert [r["image_grid_thw"].tolist() for r in micro.row_inputs or []] == [[[1, 2, 2]] * 2, [[1, 4, 8]]]
    check_rows(model, micro)
    broken = batch.select([0, 3])
    broken.row_inputs = [broken.row_inputs[1], broken.row_inputs[0]]  # type: ignore[index]
    with pytest.raises(ValueError, match="batch row 0: 8 image tokens but its images take 2"):
        check_rows(model, broken)


def test_an_observation_image_joins_the_rollout_and_is_expanded_untrained(
    tmp_path: Any, tokenizer: Any, vision: VisionInputs
) -> None:
    data = _image_rows(tmp_path, MULTI)
    engine = FakeVisionEngine(vision, tokenizer.encode("ok", add_special_tokens=False))
    settings = GeneratorSettings(default_env_class=MULTI, max_turns=3, batched=False)
    generator = Generator(engine, tokenizer, settings, vision=vision)
    out = asyncio.run(generator.generate([data[0]], 2, SamplingParams(max_tokens=4)))
    assert len(out) == 2
    # each rollout's turn 2 was sent the prompt's image then the observation's, one token each
    assert sorted(len(images) for _, images in engine.calls) == [1, 1, 2, 2]
    assert all(prompt.count(vision.image_token_id) == len(images) for prompt, images in engine.calls)
    for tr in out:
        assert tr.num_turns == 2 and tr.prompt_ids.count(vision.image_token_id) == 8
        pads = [i for i, t in enumerate(tr.response_ids) if t == vision.image_token_id]
        assert len(pads) == 2  # 56x28 -> grid 1x2x4 -> 2 tokens
        assert all(tr.loss_mask[i] == 0 and tr.rollout_logprobs[i] == 0.0 for i in pads)
        assert len(tr.response_ids) == len(tr.loss_mask) == len(tr.rollout_logprobs)
        assert tr.vision_inputs is not None and tr.vision_inputs["image_grid_thw"].tolist() == [
            [1, 4, 8],
            [1, 2, 4],
        ]
        # the turns' rewards sit on each turn's last sampled token, after the expansion
        assert [tr.loss_mask[i] for i, _ in tr.turn_rewards] == [1, 1]
        assert tr.turn_rewards[-1][0] == len(tr.response_ids) - 1 - tr.loss_mask[::-1].index(1)
    batch = trajectory_batch(out, pad_token_id=0)
    model = torch.nn.Module()
    model.config = tiny_qwen2_vl.build_config(tokenizer)  # type: ignore[assignment]
    check_rows(model, batch)
    assert vision_kwargs(model, batch)["image_grid_thw"].tolist() == [[1, 4, 8], [1, 2, 4]] * 2


class AbortingVisionEngine(FakeVisionEngine):
    """Aborts every first request after one token (a weight update with pause mode "abort"); the
    resubmitted rest (fewer `max_tokens`) completes. Like a server, refuses a request whose image
    tokens and images differ in number."""

    def __init__(self, vision: VisionInputs, reply: list[int], max_tokens: int) -> None:
        super().__init__(vision, reply)
        self.max_tokens = max_tokens
        self.resubmits = 0

    async def generate(self, prompts, params, session_id=None, *, images=None):  # type: ignore[no-untyped-def]
        for i, prompt in enumerate(prompts):
            sent = len(images[i]) if images is not None else 0
            if prompt.count(self.vision.image_token_id) != sent:
                raise ValueError(f"prompt {i} has image tokens for {sent} images")
        outputs = await super().generate(prompts, params, session_id, images=images)
        first = params.max_tokens == self.max_tokens
        self.resubmits += not first
        part = self.reply[:1] if first else self.reply[1:]
        done = Completion(part, [-0.5] * len(part), "abort" if first else "stop")
        return [GenerateOutput(out.prompt_token_ids, [done] * params.n) for out in outputs]


@pytest.mark.parametrize("env_class,turns", [(SINGLE, 1), (MULTI, 2)])
def test_an_aborted_sample_is_resubmitted_with_its_images(
    tmp_path: Any, tokenizer: Any, vision: VisionInputs, env_class: str, turns: int
) -> None:
    data = _image_rows(tmp_path, env_class)
    reply = tokenizer.encode("ok then", add_special_tokens=False)
    engine = AbortingVisionEngine(vision, reply, max_tokens=4)
    settings = GeneratorSettings(
        default_env_class=env_class, max_turns=turns, batched=turns == 1, resubmit_aborted=True
    )
    generator = Generator(engine, tokenizer, settings, vision=vision)
    out = asyncio.run(generator.generate([data[0]], 2, SamplingParams(max_tokens=4)))
    assert engine.resubmits == 2 * turns and len(out) == 2  # each sample's each turn, once
    # turn 2's resubmit (multi-turn) carried the prompt's image and the observation's
    assert max(len(images) for _, images in engine.calls) == (2 if turns > 1 else 1)
    for tr in out:
        assert tr.num_turns == turns and tr.vision_inputs is not None
        assert [t for t, m in zip(tr.response_ids, tr.loss_mask, strict=True) if m][: len(reply)] == reply


def test_images_for_a_text_only_policy_are_refused(
    tmp_path: Any, tokenizer: Any, vision: VisionInputs
) -> None:
    data = _image_rows(tmp_path, SINGLE)
    engine = FakeVisionEngine(vision, [1])
    generator = Generator(engine, tokenizer, GeneratorSettings(default_env_class=SINGLE))
    with pytest.raises(VisionError, match="prompt 0:0 has 1 image") as info:
        asyncio.run(generator.generate(list(data), 1, replace_bias(vision)))
    # the run's stop line (skylift.generator.rollout_errors): the row's fault, named once
    assert (
        rollout_input(info.value) == "prompt 0:0 has 1 image(s) but the policy is not a vision-language model"
    )


def replace_bias(vision: VisionInputs) -> SamplingParams:
    return SamplingParams(max_tokens=2, logit_bias=vision.logit_bias())


def test_the_trainer_scores_the_distribution_the_engine_sampled_without_image_tokens(tokenizer: Any) -> None:
    config = tiny_qwen2_vl.build_config(tokenizer)
    banned = banned_token_ids(config)
    assert banned == (config.image_token_id, config.video_token_id, config.vision_start_token_id)
    model = torch.nn.Module()
    model.config = config  # type: ignore[assignment]
    logits = torch.randn(2, 3, config.text_config.vocab_size)
    biased = with_sampling_bias(model, logits).log_softmax(-1)
    assert float(biased[..., list(banned)].exp().max()) < 1e-30  # never sampled
    # the other tokens' logprobs: renormalised without the banned ones, as vLLM returns them
    kept = [t for t in range(logits.shape[-1]) if t not in banned]
    torch.testing.assert_close(biased[..., kept], logits[..., kept].log_softmax(-1))
    text = torch.nn.Module()
    text.config = config.text_config  # type: ignore[assignment]  # no vision_config: unchanged
    assert with_sampling_bias(text, logits) is logits


def _config_dir(path: Any, config: Any) -> str:
    config.save_pretrained(path)
    return str(path)


def test_a_run_refuses_images_it_cannot_train_in_one_line(tmp_path: Any, tokenizer: Any) -> None:
    from transformers import Qwen2Config

    from skylift.cluster.vision_run import run_vision
    from skylift.config import ConfigError, load_config

    text_model = _config_dir(
        tmp_path / "text", Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1)
    )
    cfg = load_config(["trainer.policy.model.path=my-text-model", "generator.vision_language_generator=true"])
    with pytest.raises(
        ConfigError, match="vision_language_generator=true but my-text-model is not a vision-language"
    ):
        run_vision(cfg, text_model, [])
    data = _image_rows(tmp_path, SINGLE)
    cfg = load_config(["trainer.policy.model.path=my-text-model"])
    with pytest.raises(ConfigError, match="prompt 0:0 has images but the policy my-text-model is not"):
        run_vision(cfg, text_model, [None, data])
    assert run_vision(cfg, text_model, [None]) is None  # text rows, text policy: nothing to do
    vlm = tmp_path / "vlm"
    tiny_qwen2_vl.build_image_processor().save_pretrained(vlm)
    _config_dir(vlm, tiny_qwen2_vl.build_config(tokenizer))
    remote = load_config(["generator.run_engines_locally=false"])  # images travel over HTTP too
    assert run_vision(remote, str(vlm), [data]) is not None
