"""The RL loop on the tiny Qwen2-VL: prompts with images (an ``images`` column with ``<image>``
placeholders), sampled by vLLM with their images, trained with ``pixel_values`` /
``image_grid_thw``; single-turn, and multi-turn with an environment whose observation carries an
image. The trainer's logprobs of the sampled tokens equal the engine's at every step, so the
images reached both the same way, and step 2 samples from the weights the first sync pushed.

    flock /tmp/skylift-heavy.lock bash scripts/loopback.sh .venv/bin/pytest tests/integration/test_vision_training.py
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from server_helpers import ServerHandle, require_loopback_namespace, start_server, stop_server, wait_healthy

from skylift.config import load_config
from skylift.envs import Environment, StepResult, register_env
from skylift.models import prepare_model
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration

SINGLE = "test_vision_even_length"
MULTI = "test_vision_look_again"
LOOK_TWICE = "test_vision_look_twice"
TOLERANCE = 1e-3  # the dense tiny model's bound in fp32 (tests/integration/test_rl_trainer.py)


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


@register_env(SINGLE, override=True)
class EvenLength(Environment):
    """Reward 1 for a response of even character length: varies within a group."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


@register_env(MULTI, override=True)
class LookAgain(Environment):
    """Turn 1 is answered with another image; turn 2 is scored like `EvenLength`."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        if self.turns == 1:
            content = [
                {"type": "image", "image": _png((56, 28), (0, 0, 250))},
                {"type": "text", "text": "again?"},
            ]
            return StepResult(observations=[{"role": "user", "content": content}], reward=0.0, done=False)
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


@register_env(LOOK_TWICE, override=True)
class LookTwice(Environment):
    """Turns 1 and 2 are answered with another image each; turn 3 is scored like `EvenLength`."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        if self.turns < 3:
            colour = (0, 0, 250) if self.turns == 1 else (0, 250, 250)
            content = [
                {"type": "text", "text": f"look {self.turns}:"},
                {"type": "image", "image": _png((28 * self.turns, 28), colour)},
            ]
            return StepResult(observations=[{"role": "user", "content": content}], reward=0.0, done=False)
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


def _train_file(out: Path, env_class: str) -> Path:
    colours = [(250, 0, 0), (0, 250, 0), (0, 0, 250), (250, 250, 0)]
    rows = [
        {
            "data_source": "shapes",
            "prompt": [{"role": "user", "content": f"<image>What colour is shape {i}?"}],
            "env_class": env_class,
            "images": [{"bytes": _png((28 * (1 + i % 2), 28), colours[i % 4]), "path": None}],
        }
        for i in range(8)
    ]
    pq.write_table(pa.Table.from_pylist(rows), out / f"{env_class}.parquet")
    return out / f"{env_class}.parquet"


def _geometry3k_file(out: Path) -> Path:
    """Rows as SkyRL's geometry_3k_dataset.py writes them: the diagram as an ``image_url`` data URL
    before the question, ``reward_spec.ground_truth``, no ``data_source``."""
    rows = []
    for i in range(4):
        url = "data:image/png;base64," + base64.b64encode(_png((28 * (1 + i % 2), 28), (250, 0, 0))).decode()
        question = f"Find x if the side is {i + 1}. Check with calc_score; answer as \\boxed{{}}."
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
        rows.append(
            {
                "prompt": [{"role": "user", "content": content}],
                "env_class": "geometry3k",
                "reward_spec": {"method": "rule", "ground_truth": str(i + 1)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), out / "geometry3k.parquet")
    return out / "geometry3k.parquet"


def _overrides(tmp_path: Path, data: Path, turns: int) -> dict[str, object]:
    return {
        "trainer.policy.model.path": "tiny-qwen2-vl",
        "data.train_data": f"['{data}']",
        "data.val_data": f"['{data}']",
        "trainer.placement.backend": "local",
        "trainer.train_batch_size": 2,
        "trainer.policy_mini_batch_size": 2,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 12,
        "generator.max_turns": turns,
        "generator.batched": turns == 1,
        "generator.vision_language_generator": True,
        "trainer.max_prompt_length": 128,
        "trainer.max_steps": 2,
        "trainer.eval_interval": -1,
        "trainer.eval_before_train": False,
        "trainer.policy.optimizer_config.lr": 1e-2,
        "trainer.micro_train_batch_size_per_gpu": 3,  # micro-batches cut across a prompt's samples
        "trainer.ckpt_interval": -1,
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.resume_mode": "none",
        "trainer.log_dir": str(tmp_path / "logs"),
    }


def _fit(overrides: dict[str, object]) -> list[dict]:
    trainer = build_trainer(load_config([f"{k}={v}" for k, v in overrides.items()]), console=False)
    try:
        trainer.setup()
        return trainer.fit()
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("env_class,turns", [(SINGLE, 1), (MULTI, 2)])
def test_grpo_steps_with_images(tmp_path: Path, env_class: str, turns: int) -> None:
    history = _fit(_overrides(tmp_path, _train_file(tmp_path, env_class), turns))
    rows = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in rows] == [1, 2]
    diffs = [h["policy/logprob_diff_vs_rollout"] for h in rows]
    print(f"tiny-qwen2-vl, {turns} turn(s): |lp diff| per step {diffs}")
    assert all(d < TOLERANCE for d in diffs), diffs
    assert all(h["policy/grad_norm"] > 0 for h in rows)


def test_skyrls_geometry3k_rows_train_with_its_environment(tmp_path: Path) -> None:
    """SkyRL's geometry3k example as its script sets it up (environment.env_class=geometry3k, 3
    turns, unbatched): the rows' images reach engine and trainer alike, the environment grades."""
    overrides = _overrides(tmp_path, _geometry3k_file(tmp_path), 3)
    overrides["environment.env_class"] = "geometry3k"
    history = _fit(overrides)
    rows = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in rows] == [1, 2]
    diffs = [h["policy/logprob_diff_vs_rollout"] for h in rows]
    turns = [h["environment/geometry3k/avg_turns"] for h in rows]
    print(f"tiny-qwen2-vl, geometry3k: |lp diff| per step {diffs}, avg turns {turns}")
    assert all(d < TOLERANCE for d in diffs), diffs
    assert all(1 <= t <= 3 for t in turns) and all(
        0 <= h["environment/geometry3k/avg_acc"] <= 1 for h in rows
    )


def _post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """One `skylift serve` on tiny-qwen2-vl for this module's remote tests (each run syncs its own
    weights into it at set-up)."""
    require_loopback_namespace()
    model = prepare_model("tiny-qwen2-vl")
    args = ["--max-model-len", "512", "--dtype", "float32", "--seed", "0", "--enforce-eager"]
    log = tmp_path_factory.mktemp("vl_server") / "server.log"
    handle = start_server(model, log, [*args, "--max-num-seqs", "16"])
    try:
        wait_healthy(handle)
        yield handle
    finally:
        stop_server(handle)


def _remote(tmp_path: Path, handle: ServerHandle, env_class: str, turns: int) -> list[dict]:
    """2 GRPO steps sampled on `handle`'s server, synced over HTTP + gloo: the steps' rows."""
    overrides = _overrides(tmp_path, _train_file(tmp_path, env_class), turns)
    overrides.update(
        {
            "generator.run_engines_locally": False,
            "generator.remote_inference_engine_urls": f"['{handle.url.removeprefix('http://')}']",
            "generator.override_existing_update_group": True,
        }
    )
    rows = [h for h in _fit(overrides) if "reward/mean" in h]
    assert handle.process.poll() is None, handle.log_tail()
    assert [h["step"] for h in rows] == [1, 2]
    return rows


def test_images_travel_to_a_remote_server_and_train(tmp_path: Path, vl_server: ServerHandle) -> None:
    """A `skylift serve` server on tiny-qwen2-vl: bad images get a 400 naming them and the server
    goes on serving; 2 GRPO steps with generator.run_engines_locally=false sample with the images
    sent in /skylift/generate's body (trainer and server logprobs equal), synced over HTTP + gloo."""
    handle = vl_server
    image = base64.b64encode(_png((56, 56), (250, 0, 0))).decode()  # 4x4 patches: 4 tokens
    image_token = json.loads((prepare_model("tiny-qwen2-vl") / "config.json").read_text())["image_token_id"]
    body = {"prompt_token_ids": [[1, image_token, 3]], "sampling_params": {"max_tokens": 2}}
    bad = {
        "not base64": ([["%%"]], "prompt 0 image 0: not base64"),
        "a header of 5000x5000": (
            [[base64.b64encode(_png_header(5000, 5000)).decode()]],
            "prompt 0 image 0",
        ),
    }
    for name, (images, message) in bad.items():
        status, text = _post(handle.url + "/skylift/generate", {**body, "images": images})
        assert status == 400 and message in text, (name, status, text)
    text_prompt = {**body, "prompt_token_ids": [[1, 2, 3]], "images": [[image]]}
    status, text = _post(handle.url + "/skylift/generate", text_prompt)
    assert status == 400 and "prompt 0 has 0 image tokens" in text, text
    status, text = _post(handle.url + "/skylift/generate", {**body, "images": [[image]]})
    assert status == 200 and len(json.loads(text)["outputs"][0]["prompt_token_ids"]) > 3, text
    diffs = [h["policy/logprob_diff_vs_rollout"] for h in _remote(tmp_path, handle, SINGLE, 1)]
    print(f"tiny-qwen2-vl over HTTP: |lp diff| per step {diffs}")
    assert all(d < TOLERANCE for d in diffs), diffs


def test_observation_images_travel_to_a_remote_server_every_turn(
    tmp_path: Path, vl_server: ServerHandle
) -> None:
    """Multi-turn on the same server: turns 1 and 2 are answered with an image each, so turn 2's
    request carries 2 images and turn 3's 3 (each turn re-sends the rollout's images so far);
    trainer and server logprobs of every sampled token equal."""
    rows = _remote(tmp_path, vl_server, LOOK_TWICE, 3)
    diffs = [h["policy/logprob_diff_vs_rollout"] for h in rows]
    turns = [h["rollout/turns_mean"] for h in rows]
    print(f"tiny-qwen2-vl over HTTP, 3 turns: |lp diff| per step {diffs}, avg turns {turns}")
    assert all(d < TOLERANCE for d in diffs), diffs
    assert turns == [3.0, 3.0]
    assert all(h["policy/grad_norm"] > 0 for h in rows)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` (1 bit per pixel: a small file)."""
    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, format="PNG")
    return out.getvalue()
