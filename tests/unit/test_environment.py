"""Every SKYLIFT_* environment variable is listed in `skylift.config.environment` (and every listed
one is read somewhere); `skylift serve`'s settings are one typed dataclass built from its flags."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from skylift.config.environment import SKYLIFT_ENVIRONMENT
from skylift.config.services import InferenceServerLimits, InferenceServerSettings

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![A-Za-z0-9_])SKYLIFT_[A-Z0-9_]+")
#: not variables skylift reads: one a test sets itself (to check `$VAR` expansion in dataset
#: paths) and the listing's own name
NOT_READ = {"SKYLIFT_TEST_DATA", "SKYLIFT_ENVIRONMENT"}
LISTING = "skylift/config/environment.py"


def _names_in_code() -> dict[str, str]:
    """name -> a file that mentions it (tracked code: Python, shell scripts, the CI script)."""
    files = subprocess.run(
        ["git", "ls-files", "skylift", "scripts", "tests", "benchmarks", ".ci"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found: dict[str, str] = {}
    for rel in files:
        path = ROOT / rel
        if rel == LISTING or not path.is_file() or path.suffix not in (".py", ".sh", ""):
            continue
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, rel)
    return found


def test_every_skylift_variable_is_listed_and_every_listed_one_is_read() -> None:
    used = _names_in_code()
    unlisted = {n: f for n, f in used.items() if n not in SKYLIFT_ENVIRONMENT and n not in NOT_READ}
    assert not unlisted, f"list these in {LISTING}: {unlisted}"
    unused = sorted(set(SKYLIFT_ENVIRONMENT) - set(used))
    assert not unused, f"{LISTING} lists variables nothing reads: {unused}"
    for name, (who, what) in SKYLIFT_ENVIRONMENT.items():
        assert who and what, name


def _args(**kw: object) -> argparse.Namespace:
    base = {
        "model": "/models/m",
        "served_model_name": None,
        "host": "127.0.0.1",
        "uds": None,
        "api_key": None,
    }
    return argparse.Namespace(**{**base, **kw})


def test_inference_server_settings_come_from_the_flags_and_the_environment() -> None:
    s = InferenceServerSettings.from_args(_args(), environ={})
    assert (s.model_path, s.model_name, s.host, s.api_keys) == ("/models/m", "/models/m", "127.0.0.1", ())
    assert s.limits == InferenceServerLimits()
    env = {"VLLM_API_KEY": "k-env", "SKYLIFT_MAX_N": "8", "SKYLIFT_WEIGHT_RPC_TIMEOUT_S": "5"}
    s = InferenceServerSettings.from_args(_args(served_model_name=["tiny", "alias"]), environ=env)
    assert s.model_name == "tiny" and s.api_keys == ("k-env",)
    assert (s.limits.max_n, s.limits.weight_rpc_timeout_s) == (8, 5.0)
    s = InferenceServerSettings.from_args(_args(api_key=["a", "b"]), environ=env)
    assert s.api_keys == ("a", "b")  # --api-key wins over VLLM_API_KEY
    with pytest.raises(ValueError, match="SKYLIFT_MAX_N"):
        InferenceServerSettings.from_args(_args(), environ={"SKYLIFT_MAX_N": "many"})
