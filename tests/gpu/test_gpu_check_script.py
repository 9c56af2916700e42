"""`bash scripts/gpu_check.sh --cpu` end to end, so the GPU check cannot rot between GPU runs (issue
50's torch-only items included: one run of the script covers every item).

It runs every item of the check on CPU (gloo instead of NCCL, SmolLM2's widths at 2 layers; the
tiny Qwen3-MoE and Qwen2-VL of issue 53) with vLLM, Ray, FastAPI, uvicorn, pydantic, ... made
unimportable, as they are on the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_check(
    tmp_path: Path, *options: str, timeout_s: int
) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`gpu_check.sh --cpu OPTIONS` with its work and report under `tmp_path`: the run and the report."""
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("SKYLIFT_GPU_CHECK_BLOCK", None)  # the script's own list
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu_check.sh"),
            "--cpu",
            *options,
            "--work",
            str(tmp_path),
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.is_file(), f"no report\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    return done, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gpu_check_cpu_mode_passes_without_vllm_ray_fastapi(tmp_path: Path) -> None:
    done, report = _run_check(tmp_path, timeout_s=1700)
    failed = {
        i["key"]: (i["error"], [c for c in i["checks"] if not c["ok"]])
        for i in report["items"]
        if not i["ok"]
    }
    assert done.returncode == 0 and report["ok"], f"failed items: {failed}\n{done.stdout[-3000:]}"
    assert report["device"] == "cpu"
    assert {"vllm", "ray", "fastapi", "uvicorn"} <= set(report["blocked"])
    assert report["blocked_modules_loaded"] == []
    items = {i["key"]: i for i in report["items"]}
    colocated = ["same-gpu-group", "ipc", "stream", "offload", "cuda-stack"]  # issue 50's, torch alone
    issue_53 = ["moe", "vision"]  # mixture of experts, images: no vLLM
    assert sorted(items) == sorted(["1", "2", "3", "4", "5", "imports", *colocated, *issue_53])
    assert all(len(items[k]["checks"]) >= 5 for k in [*"12345", *issue_53] if not items[k]["skipped"])
    # only the Tinker path may be skipped, and then it names the import that is missing (the CUDA
    # stack is a GPU machine's)
    assert [k for k, i in items.items() if i["skipped"]] in (["cuda-stack"], ["5", "cuda-stack"])
    if items["5"]["skipped"]:
        assert " imports " in items["5"]["skipped"] and "lacks" in items["5"]["skipped"]
    # the tiny MoE's fused experts converted to its checkpoint's tensors (4 layers x 8 experts x
    # 3 matrices + the rest), the rows' routing replayed; the vision rows' 5 images (20 tokens)
    moe = items["moe"]["figures"]
    assert moe["checkpoint tensors (fused experts unfused)"] == 135
    assert moe["moe/replay-fp32: replayed (token, layer) pairs"] > 100
    assert items["vision"]["figures"]["batch images"] == 5
    assert items["vision"]["figures"]["batch image tokens"] == 20
    # the weight sender cut SmolLM2 (2 layers) into several bf16 buckets
    assert len(items["3"]["figures"]["buckets"]) > 1
    assert "PASS" in done.stdout
    # the stack it ran against, beside skylift's pins, and what it cannot check without vLLM
    from packaging.version import Version

    stack = report["stack"]
    assert stack["pinned"]["vllm"] == "0.32.0" and Version(stack["pinned"]["torch"])
    assert stack["torch_matches_pin"] == (report["torch"].split("+")[0] == stack["pinned"]["torch"])
    assert any("vLLM's CUDA engine" in line for line in stack["not_checked"])
    assert "not checked here" in done.stdout
    # issue 50's torch-only items (a trainer and an engine on one device): shared memory stands in
    # for CUDA IPC, the receive arenas were reused, and the report says which items it verified
    assert items["ipc"]["figures"]["path"] == "shared memory"
    assert items["stream"]["figures"]["buckets"] > 2
    status = {key: entry["status"] for key, entry in report["issue_50"].items()}
    assert status == {
        "1": "verified on cpu",
        "2": "verified on cpu",
        "3": "verified on cpu",
        "4": "not verified by this run (skipped)",
        "5": "this report",
    }
    assert "issue 50 item 3 (stream-safe receive" in done.stdout


def test_items_option_runs_only_the_named_items(tmp_path: Path) -> None:
    """`--items` selects: one cheap item, the import check beside it, nothing else."""
    done, report = _run_check(tmp_path, "--items", "cuda-stack", timeout_s=300)
    assert done.returncode == 0 and report["ok"], done.stdout[-3000:]
    assert sorted(i["key"] for i in report["items"]) == ["cuda-stack", "imports"]
