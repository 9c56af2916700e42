"""Every configuration key of SkyRL's two schemas, read from the wheels scripts/setup.sh downloads.

- ``skyrl-train`` 0.3.1 (the Hydra layout of the seed): ``skyrl_train/config/ppo_base_config.yaml``
  with the files its ``defaults`` list mounts (megatron_config under ``trainer.{policy,ref}``,
  deepspeed_config at the top, skyrl_gym_config under ``environment.skyrl_gym``).
- ``skyrl`` 0.4.0: the dataclasses of ``skyrl/train/config/config.py``, read with ``ast`` (importing
  the module needs skyrl-gym and SkyRL's backends); a field typed with another dataclass of the
  module is a group, any other field a leaf.

Leaves are dotted keys; a leaf whose default is a mapping (``engine_init_kwargs: {}``) is one key.
"""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest
import yaml
from skyrl_clients import WHEELS, wheel_dir


def _wheel(name: str) -> Path:
    path = wheel_dir() / WHEELS[name]
    if not path.is_file():
        pytest.skip(
            f"SkyRL wheel {path.name} not in {wheel_dir()}: run scripts/setup.sh (it downloads it with "
            "pip download --no-deps --python-version 3.12 --only-binary=:all:)"
        )
    return path


def _flatten(node: object, prefix: str, out: set[str]) -> None:
    if isinstance(node, dict) and node:
        for name, value in node.items():
            _flatten(value, f"{prefix}{name}.", out)
    else:
        out.add(prefix.rstrip("."))


def skyrl_train_keys() -> set[str]:
    """Leaf keys of skyrl-train 0.3.1's ``ppo_base_config.yaml`` with its mounted defaults."""
    base = "skyrl_train/config/"
    with zipfile.ZipFile(_wheel("skyrl_train")) as zf:

        def load(name: str) -> dict:
            return yaml.safe_load(zf.read(base + name)) or {}

        cfg = load("ppo_base_config.yaml")
        cfg.pop("defaults", None)
        mounts = {
            "trainer.policy.megatron_config": load("megatron_config/policy.yaml"),
            "trainer.ref.megatron_config": load("megatron_config/ref.yaml"),
            "deepspeed_config.train": load("deepspeed_config/train.yaml"),
            "deepspeed_config.eval": load("deepspeed_config/eval.yaml"),
            "environment.skyrl_gym": load("skyrl_gym_config/default.yaml"),
        }
    keys: set[str] = set()
    _flatten(cfg, "", keys)
    for prefix, tree in mounts.items():
        _flatten(tree, prefix + ".", keys)
    return keys


def _dataclasses(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[tuple[str, ast.expr]]:
    out: list[tuple[str, ast.expr]] = []
    for base in cls.bases:  # inherited fields first, as dataclasses order them
        if isinstance(base, ast.Name) and base.id in classes:
            out.extend(_fields(classes[base.id], classes))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if "ClassVar" not in ast.unparse(stmt.annotation):
                out.append((stmt.target.id, stmt.annotation))
    return out


def _group_class(annotation: ast.expr, classes: dict[str, ast.ClassDef]) -> str | None:
    names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} & set(classes)
    names.discard("BaseConfig")
    return next(iter(names)) if len(names) == 1 else None


def skyrl_keys() -> set[str]:
    """Leaf keys of skyrl 0.4.0's ``SkyRLTrainConfig`` (dataclasses of skyrl/train/config/config.py)."""
    with zipfile.ZipFile(_wheel("skyrl")) as zf:
        tree = ast.parse(zf.read("skyrl/train/config/config.py").decode())
    classes = _dataclasses(tree)
    keys: set[str] = set()

    def walk(cls_name: str, prefix: str) -> None:
        for name, annotation in _fields(classes[cls_name], classes):
            group = _group_class(annotation, classes)
            if group is not None:
                walk(group, f"{prefix}{name}.")
            else:
                keys.add(f"{prefix}{name}")

    walk("SkyRLTrainConfig", "")
    return keys
