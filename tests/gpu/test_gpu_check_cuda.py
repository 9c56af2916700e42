"""The GPU check on CUDA (skipped without it; on a GPU machine `bash scripts/gpu_check.sh` runs the
same without pytest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: the GPU check's device paths (scripts/gpu_check.sh runs them on a GPU machine)",
)
ROOT = Path(__file__).resolve().parents[2]


def test_weight_buckets_on_cuda_equal_the_weights(tmp_path: Path) -> None:
    from gpucheck.device import Context
    from gpucheck.models import smollm2_dir, tiny_qwen2_dir
    from gpucheck.report import Item
    from gpucheck.weights import item_weights

    ctx = Context(tmp_path, tiny_qwen2_dir(), smollm2_dir(tmp_path, 4), 4)
    item = Item("3", "weight sender on CUDA")
    item_weights(ctx, item)
    assert item.ok, [c for c in item.checks if not c.ok]
    assert item.figures["group"].startswith("nccl")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_script_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--work", str(tmp_path), "--out", str(out)],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=880,
    )
    report = json.loads(out.read_text())
    assert report["device"] == "cuda"
    assert done.returncode == 0 and report["ok"], done.stdout[-4000:]
