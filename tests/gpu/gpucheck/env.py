"""The process environment of the check: blocked imports, carried wheels, package-less imports.

The GPU machine has torch, transformers, peft, numpy, safetensors, aiohttp and httpx, and no
package index. `BLOCKED` are packages it does not have (or that the check must not need): a
meta-path finder makes them unimportable in every process of the check, whatever is installed
here, and records who asked. `CARRIED_WHEELS` are the small pure-Python wheels to bring along
(`scripts/gpu_check.sh --fetch-wheels DIR` downloads them; `--wheels DIR` unpacks them onto
`sys.path`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
import zipfile
from pathlib import Path

# Not on the GPU machine: vLLM's CUDA wheels are too large to carry, Ray and the HTTP stack are
# not needed for training; pydantic & co. are what the tinker SDK's package __init__ needs.
BLOCKED = (
    "vllm",
    "ray",
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "sqlalchemy",
    "alembic",
    "mako",
    "omegaconf",
    "antlr4",
)
BLOCK_ENV = "SKYLIFT_GPU_CHECK_BLOCK"

# (pip requirement, the module it provides, why) — every one is pure Python (py3-none-any). A
# wheel whose module the machine already has is not used (no mixing of two versions).
CARRIED_WHEELS = (
    (
        "tinker==0.38.0",
        "tinker",
        "tinker.proto: the protobuf schema of the Tinker wire format (skylift.tinker.core.wire)",
    ),
    ("protobuf==6.33.5", "google.protobuf", "google.protobuf, pure-Python build, for tinker.proto"),
)


class BlockedImports(importlib.abc.MetaPathFinder):
    """Raise ModuleNotFoundError for the blocked packages (and their submodules); remember who
    imported them. Names may be dotted (`google._upb` hides protobuf's compiled backend)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = frozenset(names)
        self.attempts: list[dict[str, str]] = []

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if not any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return None
        self.attempts.append({"module": fullname, "imported_by": _importer()})
        raise ModuleNotFoundError(
            f"No module named {fullname!r} (blocked by the GPU check: the GPU machine does not have it)",
            name=fullname,
        )


def _importer() -> str:
    """The module whose code ran the import statement (the first frame outside importlib)."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<frozen importlib") and "importlib" not in filename:
            return str(frame.f_globals.get("__name__", filename))
        frame = frame.f_back
    return "?"


_blocker: BlockedImports | None = None


def install_blocker() -> BlockedImports:
    """Block `$SKYLIFT_GPU_CHECK_BLOCK` (comma-separated; default `BLOCKED`) in this process."""
    global _blocker
    if _blocker is None:
        names = tuple(n for n in os.environ.get(BLOCK_ENV, ",".join(BLOCKED)).split(",") if n)
        os.environ[BLOCK_ENV] = ",".join(names)  # child processes block the same
        _blocker = BlockedImports(names)
        sys.meta_path.insert(0, _blocker)
    return _blocker


def why_blocked(exc: ImportError) -> str:
    """'<importer> imports <module>' for a blocked import that failed, else the error itself."""
    if _blocker is not None:
        for attempt in reversed(_blocker.attempts):
            if attempt["module"] == exc.name:
                return f"{attempt['imported_by']} imports {exc.name}, which this machine lacks"
    return str(exc)


def loaded_blocked_modules() -> list[str]:
    """Blocked packages that are nevertheless in `sys.modules` (imported before the blocker)."""
    names = _blocker.names if _blocker else frozenset(BLOCKED)
    return sorted({n for n in names for m in list(sys.modules) if m == n or m.startswith(n + ".")})


def _provides(wheel: Path) -> str | None:
    dist = wheel.name.split("-")[0].replace("_", "-").lower()
    return next((module for req, module, _ in CARRIED_WHEELS if req.split("==")[0] == dist), None)


def add_wheels(wheel_dir: str | Path, into: str | Path) -> dict[str, str]:
    """Unpack the pure-Python wheels of `wheel_dir` into `into`, first on `sys.path`; a carried
    wheel whose module is already importable is left out. Returns {wheel: "added" | why not}."""
    wheels = sorted(Path(wheel_dir).glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no .whl files in {wheel_dir}")
    target = Path(into)
    target.mkdir(parents=True, exist_ok=True)
    used: dict[str, str] = {}
    for wheel in wheels:
        if not wheel.name.endswith("-none-any.whl"):
            raise ValueError(f"{wheel.name} is not a pure-Python wheel (...-none-any.whl)")
        module = _provides(wheel)
        if module and importlib.util.find_spec(module) is not None:
            used[wheel.name] = f"not used: this machine has {module}"
            continue
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        used[wheel.name] = "added"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return used


_skipped_inits: dict[str, str] = {}


def import_skipping_package_init(module: str, package: str) -> tuple[types.ModuleType, str | None]:
    """Import `module` (inside `package`); if the package's `__init__` cannot be imported here,
    import the module without running it. Returns (module, why the __init__ was skipped or None;
    the reason stays the same on later calls)."""
    try:
        return importlib.import_module(module), _skipped_inits.get(package)
    except ImportError as exc:
        why = f"{package}/__init__ needs {exc.name!r}: {exc}"
        _skipped_inits[package] = why
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed", name=package)
    stub = types.ModuleType(package, f"{package} without its __init__ (GPU check)")
    stub.__path__ = list(spec.submodule_search_locations)
    stub.__spec__ = spec
    sys.modules[package] = stub
    parent, _, child = package.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, stub)
    return importlib.import_module(module), why
