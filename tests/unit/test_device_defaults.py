"""GPU defaults with a fake device: bf16 engines and training and CUDA graphs where CUDA is seen,
the CPU's defaults elsewhere, and a key the user set keeps its value on any device."""

from __future__ import annotations

from pathlib import Path

import pytest

from skylift.cluster.settings import local_engine_kwargs
from skylift.config import load_config
from skylift.config import loading as config_loading
from skylift.config.device_defaults import GPU_DEFAULTS


def _fake_device(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    monkeypatch.setattr(config_loading, "cuda_available", lambda: cuda)


def test_cpu_keeps_the_schema_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_device(monkeypatch, cuda=False)
    cfg = load_config()
    assert (cfg.generator.model_dtype, cfg.trainer.bf16, cfg.generator.enforce_eager) == (
        "float32",
        False,
        True,
    )


def test_gpu_gets_bf16_and_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_device(monkeypatch, cuda=True)
    cfg = load_config()
    assert (cfg.generator.model_dtype, cfg.trainer.bf16, cfg.generator.enforce_eager) == (
        "bfloat16",
        True,
        False,
    )
    assert set(GPU_DEFAULTS) == {"generator.model_dtype", "trainer.bf16", "generator.enforce_eager"}
    kwargs = local_engine_kwargs(cfg, sleep_mode=False)  # what the engines are started with
    assert kwargs["dtype"] == "bfloat16" and kwargs["enforce_eager"] is False


def test_keys_the_user_set_win_on_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_device(monkeypatch, cuda=True)
    cfg = load_config(["generator.enforce_eager=true", "trainer.bf16=false"])
    assert (cfg.generator.model_dtype, cfg.trainer.bf16, cfg.generator.enforce_eager) == (
        "bfloat16",
        False,
        True,
    )
    config_file = tmp_path / "run.yaml"  # from a file, set to the CPU default's value
    config_file.write_text("generator:\n  model_dtype: float32\n")
    cfg = load_config(config_file=config_file)
    assert (cfg.generator.model_dtype, cfg.trainer.bf16) == ("float32", True)
