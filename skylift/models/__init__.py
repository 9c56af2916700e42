"""Offline models: a registry of models skylift can build without network access, and a disk cache.

``prepare_model(name)`` builds a registry model once into ``<cache>/models/<name>`` and returns the
directory; ``resolve_model_path`` lets anything that accepts a model path also accept these names.
"""

from skylift.models.cache import model_cache_dir
from skylift.models.registry import (
    ModelPathError,
    ModelSpec,
    is_missing_local_path,
    is_prepared,
    list_models,
    prepare_model,
    resolve_model_path,
)

__all__ = [
    "ModelPathError",
    "ModelSpec",
    "is_missing_local_path",
    "is_prepared",
    "list_models",
    "model_cache_dir",
    "prepare_model",
    "resolve_model_path",
]
