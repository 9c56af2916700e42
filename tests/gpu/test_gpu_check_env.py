"""The GPU check's process helpers: blocked imports, carried wheels, imports past a package __init__."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(tmp_path)]), **env)
    return subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120
    )


def test_blocked_package_cannot_be_imported_and_the_importer_is_recorded(tmp_path: Path) -> None:
    (tmp_path / "needs_blocked.py").write_text("import json_blocked_probe\n")
    code = (
        "from gpucheck.env import install_blocker\n"
        "b = install_blocker()\n"
        "try:\n"
        "    import needs_blocked\n"
        "except ModuleNotFoundError as e:\n"
        "    print('blocked', e.name)\n"
        "print(b.attempts)\n"
        "import json\n"  # not blocked
    )
    done = _python(code, tmp_path, SKYLIFT_GPU_CHECK_BLOCK="json_blocked_probe")
    assert done.returncode == 0, done.stderr
    assert "blocked json_blocked_probe" in done.stdout
    assert "'imported_by': 'needs_blocked'" in done.stdout


def test_default_block_list_covers_what_the_gpu_machine_lacks() -> None:
    from gpucheck.env import BLOCKED

    assert {"vllm", "ray", "fastapi", "uvicorn"} <= set(BLOCKED)


def _wheel(directory: Path, name: str, module: str, source: str) -> Path:
    path = directory / name
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}/__init__.py", source)
    return path


def test_pure_wheels_are_unpacked_onto_sys_path(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "probe_pkg-1.0-py3-none-any.whl", "gpucheck_probe_pkg", "VALUE = 41 + 1\n")
    code = (
        "from gpucheck.env import add_wheels\n"
        f"print(add_wheels({str(wheels)!r}, {str(tmp_path / 'site')!r}))\n"
        "import gpucheck_probe_pkg\n"
        "print(gpucheck_probe_pkg.VALUE)\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "'probe_pkg-1.0-py3-none-any.whl': 'added'" in done.stdout and "42" in done.stdout.split()


def test_a_carried_wheel_the_machine_already_has_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpucheck.env import add_wheels

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    _wheel(tmp_path, "protobuf-6.33.5-py3-none-any.whl", "google/protobuf", "")
    used = add_wheels(tmp_path, tmp_path / "site")  # this machine has google.protobuf
    assert used == {"protobuf-6.33.5-py3-none-any.whl": "not used: this machine has google.protobuf"}


def test_a_binary_wheel_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucheck.env import add_wheels

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    _wheel(tmp_path, "fast-1.0-cp311-cp311-linux_x86_64.whl", "fast", "")
    with pytest.raises(ValueError, match="not a pure-Python wheel"):
        add_wheels(tmp_path, tmp_path / "site")


def test_module_imported_past_a_failing_package_init(tmp_path: Path) -> None:
    pkg = tmp_path / "probe_parent"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import absent_web_framework_probe\n")
    (pkg / "useful.py").write_text("ANSWER = 42\n")
    code = (
        "from gpucheck.env import import_skipping_package_init\n"
        "mod, why = import_skipping_package_init('probe_parent.useful', 'probe_parent')\n"
        "print(mod.ANSWER)\n"
        "print(why)\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "42"
    assert "absent_web_framework_probe" in lines[1]
