"""SkyRL's real client code for the tests: the `skyrl-train` 0.3.1 and `skyrl` 0.4.0 wheels that
scripts/setup.sh downloads (never installs) into `$SKYLIFT_CACHE_DIR/wheels/skyrl`
(default ~/.cache/skylift/wheels/skyrl).

`load()` unpacks each wheel once beside it (the wheels hold namespace packages, which Python
cannot import from a zip) and puts the directories on sys.path. Two adjustments to the
environment, not to SkyRL's code, let these Python-3.12 wheels import on this Python 3.11 / Ray
2.60 environment:
- Ray 2.60 no longer re-exports `PlacementGroupSchedulingStrategy` from
  `ray.util.placement_group`, where skyrl-train 0.3.1 imports it from; it is aliased there.
- `skyrl.backends/__init__.py` imports SkyRL's Tinker backend, whose pydantic models need Python
  3.12's `typing.TypedDict`; the package is entered without running that `__init__` (the client
  modules under it do not use it).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

WHEELS = {
    "skyrl_train": "skyrl_train-0.3.1-py3-none-any.whl",
    "skyrl": "skyrl-0.4.0-py3-none-any.whl",
}


def wheel_dir() -> Path:
    cache = Path(os.environ.get("SKYLIFT_CACHE_DIR") or Path.home() / ".cache" / "skylift")
    return cache / "wheels" / "skyrl"


def _unpacked(wheel: Path) -> Path:
    target = wheel.parent / "unpacked" / wheel.stem
    marker = target / ".complete"
    if not marker.exists():
        target.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
        marker.touch()
    return target


def load() -> None:
    """Make `skyrl_train` (0.3.1) and `skyrl` (0.4.0) importable, or skip saying how to get them."""
    if "skyrl_train" in sys.modules and "skyrl.backends" in sys.modules:
        return
    missing = [name for name in WHEELS.values() if not (wheel_dir() / name).is_file()]
    if missing:
        pytest.skip(
            f"SkyRL client wheels {missing} not in {wheel_dir()}: run scripts/setup.sh (it downloads "
            "them with pip download --no-deps --python-version 3.12 --only-binary=:all:)"
        )
    for name in WHEELS.values():
        path = str(_unpacked(wheel_dir() / name))
        if path not in sys.path:
            sys.path.insert(0, path)
    placement = importlib.import_module("ray.util.placement_group")
    if not hasattr(placement, "PlacementGroupSchedulingStrategy"):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placement.PlacementGroupSchedulingStrategy = PlacementGroupSchedulingStrategy  # type: ignore[attr-defined]
    import skyrl

    backends = types.ModuleType("skyrl.backends")
    backends.__path__ = [str(Path(skyrl.__path__[0]) / "backends")]
    sys.modules["skyrl.backends"] = backends
