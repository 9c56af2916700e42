"""`skylift eval --checkpoint PATH` (skylift.rl.eval_weights) on the tiny model, without vLLM: what
a path resolves to, the clear errors (neither kind, incomplete, another model), and the weights a
trainer checkpoint or an export loads (the checkpoint read as resume reads it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from skylift.config import ConfigError, load_config
from skylift.entrypoints.main_generate import main as eval_main
from skylift.rl import checkpoint as ckpt
from skylift.rl.eval_weights import (
    EvalWeights,
    export_for_engines,
    frozen_policy,
    resolve_eval_weights,
)
from skylift.worker.training_worker import TrainingWorker, WorkerSettings


def _config(tmp_path: Path, model: Path, *extra: str):
    return load_config(
        [
            f"trainer.policy.model.path={model}",
            f"data.val_data=['{tmp_path / 'val.parquet'}']",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            *extra,
        ]
    )


def _trained_checkpoint(model: Path, ckpt_root: Path, step: int = 3) -> dict[str, torch.Tensor]:
    """A complete trainer checkpoint of `model` with shifted weights, written as the loop writes
    one (`policy/` by the worker, then the state and the marker); returns the saved weights."""
    worker = TrainingWorker(WorkerSettings(model_path=str(model)))
    worker.setup()
    with torch.no_grad():
        for i, param in enumerate(worker._model().parameters()):
            param.add_(0.01 * (i + 1))
    tmp = ckpt.begin_checkpoint(ckpt_root, step)
    worker.save_checkpoint(str(tmp / "policy"))
    ckpt.commit_checkpoint(ckpt_root, step, ckpt.TrainerState(global_step=step, policy_version=step))
    weights = {k: v.clone() for k, v in worker.iter_full_weights()}
    worker.shutdown()
    return weights


def _other_model(tiny_model_dir: Path, out: Path) -> Path:
    """A model of another shape (a wider MLP) beside the tiny one, with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size += 16
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in tiny_model_dir.iterdir():
        if "token" in name.name or name.suffix in (".txt", ".jinja"):
            shutil.copy(name, out / name.name)
    return out


@pytest.fixture(scope="module")
def saved(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("eval_ckpts") / "ckpts"
    return root, _trained_checkpoint(tiny_model_dir, root)


def test_paths_resolve_to_a_checkpoint_or_a_hugging_face_directory(
    saved: tuple[Path, dict], tiny_model_dir: Path, tmp_path: Path
) -> None:
    root, _ = saved
    step = root / "global_step_3"
    assert resolve_eval_weights(step, str(tiny_model_dir)) == EvalWeights("checkpoint", step, 3, 3)
    assert resolve_eval_weights(root, str(tiny_model_dir)).path == step  # the latest complete one
    hf = resolve_eval_weights(tiny_model_dir, str(tiny_model_dir))
    assert hf.kind == "hf" and hf.path == tiny_model_dir and hf.policy_version == 0
    export = tmp_path / "exports" / "global_step_7"
    shutil.copytree(tiny_model_dir, export)
    assert resolve_eval_weights(export, "tiny-qwen2") == EvalWeights("hf", export, 7)  # a registry name


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "no such file or directory"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "neither a trainer checkpoint"),
        (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "neither a trainer checkpoint"),
        (lambda p: (p / "global_step_2" / "policy").mkdir(parents=True) or p / "global_step_2", "incomplete"),
        (lambda p: (p / "global_step_4.partial").mkdir() or p / "global_step_4.partial", "incomplete"),
    ],
)
def test_a_path_of_neither_kind_is_refused_saying_what_was_expected(
    make, message: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_eval_weights(make(tmp_path), str(tiny_model_dir))


def test_an_incomplete_checkpoint_names_the_latest_complete_one(
    saved: tuple[Path, dict], tiny_model_dir: Path
) -> None:
    root, _ = saved
    partial = ckpt.partial_dir(root, 5)
    partial.mkdir()
    try:
        with pytest.raises(ConfigError, match=r"no COMPLETE marker.*latest complete one is .*global_step_3"):
            resolve_eval_weights(partial, str(tiny_model_dir))
    finally:
        partial.rmdir()


def test_an_export_of_another_model_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = _other_model(tiny_model_dir, tmp_path / "other")
    with pytest.raises(ConfigError, match=r"intermediate_size \d+ \(the model's: \d+\)"):
        resolve_eval_weights(other, str(tiny_model_dir))


def test_a_checkpoint_loads_as_resume_loads_it_and_exports(
    saved: tuple[Path, dict], tiny_model_dir: Path, tmp_path: Path
) -> None:
    root, weights = saved
    cfg = _config(tmp_path, tiny_model_dir)
    resolved = resolve_eval_weights(root, str(tiny_model_dir))
    group = frozen_policy(cfg, resolved)
    try:
        loaded = dict(group.workers[0].iter_full_weights())
        assert group.workers[0].optimizer is None  # evaluation only: no optimizer state read
    finally:
        group.shutdown()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    exported = export_for_engines(cfg, resolved, tmp_path / "export")  # what local engines start on
    from safetensors.torch import load_file

    on_disk = load_file(str(exported / "model.safetensors"))
    assert all(torch.equal(on_disk[k], weights[k]) for k in on_disk) and (exported / "config.json").is_file()
    assert export_for_engines(cfg, EvalWeights("hf", tiny_model_dir), tmp_path / "unused") == tiny_model_dir


def test_a_checkpoint_of_another_model_is_refused_naming_the_weights(
    saved: tuple[Path, dict], tiny_model_dir: Path, tmp_path: Path
) -> None:
    root, _ = saved
    other = _other_model(tiny_model_dir, tmp_path / "other")
    with pytest.raises(
        ValueError, match=r"does not hold the weights of the configured model.*shaped differently"
    ):
        frozen_policy(_config(tmp_path, other), resolve_eval_weights(root, str(other)))
    lora = _config(tmp_path, tiny_model_dir, "trainer.policy.model.lora.rank=4")
    with pytest.raises(
        ValueError, match=r"missing from the checkpoint: base_model\.model\..*not in the model"
    ):
        frozen_policy(lora, resolve_eval_weights(root, str(tiny_model_dir)))


def test_the_command_refuses_a_bad_path_before_starting_anything(
    saved: tuple[Path, dict], tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = saved
    args = [f"trainer.policy.model.path={tiny_model_dir}", f"data.val_data=['{tmp_path / 'v.parquet'}']"]
    assert eval_main(["--dry-run", "--checkpoint", str(tmp_path / "nowhere"), *args]) == 2
    assert "configuration error: --checkpoint" in capsys.readouterr().err
    assert eval_main(["--dry-run", "--checkpoint", str(root), *args]) == 0
    capsys.readouterr()
    as_model = [f"trainer.policy.model.path={root / 'global_step_3'}", args[1]]
    assert eval_main(["--dry-run", *as_model]) == 2
    assert "is a trainer checkpoint, not a model: set it to the run's model" in capsys.readouterr().err


def test_model_mismatch_names_what_differs() -> None:
    from skylift.worker.checkpoint_match import model_mismatch

    model = {"a": (2, 3), "b": (4,)}
    assert model_mismatch({"a": (2, 3), "b": (4,)}, model, "m") is None
    assert model_mismatch({"a": (2, 3), "b": (4,), "extra": (1,)}, model, "m") is None  # skipped on load
    message = model_mismatch({"a": (3, 3), "c": (1,)}, model, "m")
    assert message is not None and "configured model m" in message
    assert "1 missing from the checkpoint: b" in message and "1 not in the model: c" in message
    assert "1 shaped differently: a (3, 3) (the model's: (2, 3))" in message
    many = model_mismatch({}, {f"w{i}": (1,) for i in range(5)}, "m")
    assert many is not None and "5 missing from the checkpoint: w0, w1, w2 and 2 more" in many
