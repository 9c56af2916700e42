"""Tests of skylift.models with the tiny-qwen2 recipe: determinism, tokenizer, chat template, cache, CLI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from skylift.models import ModelPathError, list_models, model_cache_dir, prepare_model, resolve_model_path
from skylift.models.cache import MARKER_FILE, build_atomically, file_lock
from skylift.models.commands import add_models_command
from skylift.models.tiny_qwen2 import QWEN2_SPLIT_PATTERN, train_tokenizer

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "23 + 45 = 68\n#### 68",
    "  two leading spaces, a tab\tand\n\nblank lines  ",
    "Café déjà vu — naïve; Grüße aus München",
    "日本語のテキスト and emoji 🙂🚀",
    "0123456789 3.14159 -42 1e-5",
    "<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n",
    "It's, we'll, they're: contractions. UPPER lower MiXeD",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny-qwen2 prepared into a private cache for this module."""
    return prepare_model("tiny-qwen2", cache_dir=tmp_path_factory.mktemp("cache_a"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_two_builds_are_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    other = prepare_model("tiny-qwen2", cache_dir=tmp_path / "cache_b")
    assert torch.equal(torch.rand(3), expected_draw), "building consumed the caller's torch RNG"
    assert other != tiny_dir
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (other / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    forced = prepare_model("tiny-qwen2", force=True, cache_dir=tmp_path / "cache_b")
    assert forced == other
    assert (forced / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_architecture_size_and_untied_embeddings(tiny_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_dir)
    assert config.model_type == "qwen2"
    assert config.tie_word_embeddings is False
    assert config.hidden_size // config.num_attention_heads == 32  # smallest head size vLLM CPU supports
    assert config.num_key_value_heads < config.num_attention_heads
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.8e6 <= n_params <= 1.3e6, n_params
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_vocabulary_and_special_tokens(tiny_dir: Path, tokenizer) -> None:
    assert 1000 <= len(tokenizer) <= 2000
    assert AutoConfig.from_pretrained(tiny_dir).vocab_size == len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == endoftext
    generation = GenerationConfig.from_pretrained(tiny_dir)
    assert generation.eos_token_id == im_end and generation.pad_token_id == endoftext
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.encode(special) == [tokenizer.convert_tokens_to_ids(special)]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_digits_are_split_one_by_one(tokenizer) -> None:
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("12345"))
    assert tokens == ["1", "2", "3", "4", "5"]
    assert len(tokenizer.encode("the answer")) < len("the answer")  # merges were learned


def test_autotokenizer_reloads_the_trained_tokenizer_identically(tokenizer) -> None:
    trained = json.loads(train_tokenizer().to_str())
    reloaded = json.loads(tokenizer.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        assert reloaded[key] == trained[key], key
    assert reloaded["model"]["vocab"] == trained["model"]["vocab"]
    assert reloaded["model"]["merges"] == trained["model"]["merges"]
    split = reloaded["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == QWEN2_SPLIT_PATTERN and split["behavior"] == "Isolated"
    byte_level = reloaded["pre_tokenizer"]["pretokenizers"][1]
    assert byte_level["use_regex"] is False and byte_level["add_prefix_space"] is False
    raw = train_tokenizer()
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.encode(text) == raw.encode(text).ids


def test_chat_template_is_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7 times 8?"},
        {"role": "assistant", "content": "56"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n"
        "<|im_start|>assistant\n56<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert not tokenizer.apply_chat_template(messages[:2], tokenize=False).endswith("assistant\n")


def test_forward_backward_and_generate(tiny_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    batch = tokenizer(["23 + 45 = 68", "Hello there, how are you?"], return_tensors="pt", padding=True)
    out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


def test_prepared_model_is_returned_without_rebuilding(tiny_dir: Path) -> None:
    marker = tiny_dir / MARKER_FILE
    before = (marker.stat().st_mtime_ns, (tiny_dir / "model.safetensors").stat().st_ino)
    again = prepare_model("tiny-qwen2", cache_dir=tiny_dir.parent.parent)
    assert again == tiny_dir
    assert (marker.stat().st_mtime_ns, (tiny_dir / "model.safetensors").stat().st_ino) == before


def test_unknown_model_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        prepare_model("tiny-qwen3", cache_dir=tmp_path)
    message = str(info.value)
    assert "tiny-qwen3" in message
    for spec in list_models():
        assert spec.name in message


def test_list_models() -> None:
    names = [spec.name for spec in list_models()]
    assert names == ["tiny-qwen2", "tiny-qwen2-vl", "tiny-qwen3-moe", "tiny-mixtral", "smollm2-135m-instruct"]
    assert all(spec.description and spec.approx_size_mb > 0 for spec in list_models())


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SKYLIFT_CACHE_DIR", str(tmp_path))
    assert model_cache_dir() == tmp_path
    monkeypatch.delenv("SKYLIFT_CACHE_DIR")
    assert model_cache_dir() == Path.home() / ".cache" / "skylift"


def test_resolve_model_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SKYLIFT_CACHE_DIR", str(tmp_path / "cache"))
    resolved = resolve_model_path("tiny-qwen2")
    assert resolved == str(tmp_path / "cache" / "models" / "tiny-qwen2")
    assert (Path(resolved) / MARKER_FILE).is_file()
    local = tmp_path / "my-model"
    local.mkdir()
    assert resolve_model_path(str(local)) == str(local)
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize("written", ["/no/such/model", "./no-such-model", "~/no-such-model-here"])
def test_a_missing_local_path_is_not_taken_for_a_hub_id(written: str) -> None:
    with pytest.raises(ModelPathError, match=f"model '{written}': no such directory on this machine"):
        resolve_model_path(written)


def test_failed_build_leaves_no_directory(tmp_path: Path) -> None:
    def broken(out_dir: Path) -> None:
        (out_dir / "half-written").write_text("x")
        raise RuntimeError("recipe failed")

    with pytest.raises(RuntimeError, match="recipe failed"):
        build_atomically("broken", broken, recipe_version=1, cache_dir=tmp_path)
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_lock_wait_times_out_with_clear_error(tmp_path: Path) -> None:
    lock = tmp_path / "models" / ".held.lock"
    with file_lock(lock):
        errors: list[BaseException] = []

        def other() -> None:
            try:
                build_atomically(
                    "held", lambda d: None, recipe_version=1, cache_dir=tmp_path, lock_timeout_s=0.5
                )
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    assert str(lock) in str(errors[0])


def test_concurrent_processes_prepare_once(tmp_path: Path) -> None:
    code = "import sys; from skylift.models import prepare_model; print(prepare_model('tiny-qwen2', cache_dir=sys.argv[1]))"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    expected = str(tmp_path / "models" / "tiny-qwen2")
    assert outputs == [expected, expected]
    entries = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert entries == [".tiny-qwen2.lock", "tiny-qwen2"]
    assert (tmp_path / "models" / "tiny-qwen2" / MARKER_FILE).is_file()


def test_models_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="skylift")
    add_models_command(parser.add_subparsers(dest="command", required=True))

    args = parser.parse_args(["models", "list", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    listing = capsys.readouterr().out
    assert "tiny-qwen2" in listing and "smollm2-135m-instruct" in listing and " no " in listing

    args = parser.parse_args(["models", "prepare", "tiny-qwen2", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    assert str(tmp_path / "models" / "tiny-qwen2") in capsys.readouterr().out

    args = parser.parse_args(["models", "list", "--cache-dir", str(tmp_path)])
    args.func(args)
    tiny_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny-qwen2"))
    assert " yes " in tiny_row

    args = parser.parse_args(["models", "prepare", "nope", "--cache-dir", str(tmp_path)])
    with pytest.raises(
        SystemExit,
        match="known models: tiny-qwen2, tiny-qwen2-vl, tiny-qwen3-moe, tiny-mixtral, smollm2-135m-instruct",
    ):
        args.func(args)
