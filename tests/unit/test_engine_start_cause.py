"""`vllm_patches.start_cause`: a vLLM child process's start-up failure reaches the starting process
as one line (the real engine start is `tests/integration/test_local_engine.py`'s)."""

from __future__ import annotations

import logging
import os
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest

from skylift.inference.local import start_failure
from skylift.inference.vllm_patches import start_cause

ROOT = Path(__file__).resolve().parents[2]


def _log_error(logger: logging.Logger, exc: Exception, message: str) -> None:
    try:
        raise exc
    except Exception:
        logger.exception(message)


def test_the_first_error_logged_with_an_exception_is_written_while_a_start_is_recorded() -> None:
    start_cause.install()
    start_cause.install()  # idempotent: one handler
    vllm_logger = logging.getLogger("vllm")
    assert sum(getattr(h, "_skylift_start_cause", False) for h in vllm_logger.handlers) == 1
    child = logging.getLogger("vllm.v1.engine.core")  # where vLLM logs "EngineCore failed to start."
    before = os.environ.get(start_cause.CAUSE_ENV)
    with start_cause.recording() as path:
        assert os.environ[start_cause.CAUSE_ENV] == str(path)
        child.error("an error without an exception is not a cause")
        assert start_cause.read_cause(path) is None
        _log_error(child, ValueError("No available memory for the cache blocks.\n  Try more."), "failed")
        _log_error(child, RuntimeError("WorkerProc initialization failed"), "the later report")
        assert (
            start_cause.read_cause(path) == "ValueError: No available memory for the cache blocks. Try more."
        )
    assert os.environ.get(start_cause.CAUSE_ENV) == before
    assert not path.exists()  # the recording's folder is removed with it


def test_nothing_is_written_outside_a_recorded_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    start_cause.install()
    monkeypatch.delenv(start_cause.CAUSE_ENV, raising=False)
    _log_error(logging.getLogger("vllm.worker"), ValueError("boom"), "failed")
    assert list(tmp_path.iterdir()) == []


def test_a_long_cause_is_cut() -> None:
    text = start_cause.describe(ValueError("x" * 5000))
    assert (
        len(text) == start_cause.MAX_CAUSE_CHARS
        and text.startswith("ValueError: xxx")
        and text.endswith("...")
    )


def test_the_start_error_names_the_engine_the_cause_and_its_memory_arguments() -> None:
    args = SimpleNamespace(
        gpu_memory_utilization=0.9, kv_cache_memory_bytes=None, max_model_len=4096, max_num_seqs=8
    )
    error = start_failure(
        "engine-0", RuntimeError("Engine core initialization failed."), "ValueError: no room", args
    )
    assert str(error) == (
        "engine-0 did not start: ValueError: no room "
        "(this engine: gpu_memory_utilization 0.9, max_model_len 4096, max_num_seqs 8)"
    )
    # no cause logged (the failure was in this process): vLLM's own message
    bare = start_failure("e", RuntimeError("bad\nargs"), None, SimpleNamespace())
    assert str(bare) == "e did not start: bad args"


def test_the_plugin_is_declared_and_installed_where_vllm_looks() -> None:
    """vLLM loads `vllm.general_plugins` entry points in its engine core and workers; a checkout
    whose installed metadata lacks ours (a stale `skylift.egg-info`) would silently lose the cause."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["vllm.general_plugins"] == {
        "skylift_start_cause": "skylift.inference.vllm_patches.start_cause:install"
    }
    installed = {e.name: e for e in entry_points(group="vllm.general_plugins")}
    assert "skylift_start_cause" in installed, (
        "reinstall skylift (pip install -e .): its entry points are stale"
    )
    assert installed["skylift_start_cause"].load() is start_cause.install


def test_a_config_vllm_refuses_reads_as_one_line() -> None:
    """`skylift serve` prints vLLM's config refusals (pydantic errors of some 60 lines) this way."""
    import pydantic

    from skylift.utils.messages import config_error

    class Config(pydantic.BaseModel):
        size: int

        @pydantic.field_validator("size")
        @classmethod
        def positive(cls, value: int) -> int:
            if value <= 0:
                raise ValueError("size must be positive.")
            return value

    with pytest.raises(pydantic.ValidationError) as caught:
        Config(size=-1)
    assert config_error(caught.value) == "size must be positive"
    assert config_error(ValueError("plain")) == "plain"
