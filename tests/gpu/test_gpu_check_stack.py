"""The GPU check's view of the stack: skylift's pins as pyproject.toml writes them."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpucheck.stack import NOT_CHECKED, pins, stack_header  # noqa: E402


def test_pins_are_pyprojects() -> None:
    project = tomllib.loads((HERE.parents[1] / "pyproject.toml").read_text())["project"]
    found = pins()
    assert f"torch=={found['torch']}" in project["dependencies"]
    assert f"vllm=={found['vllm']}" in project["optional-dependencies"]["gpu"]


def test_the_header_says_when_the_machines_torch_is_not_the_pin() -> None:
    pinned = pins()["torch"]
    assert stack_header(pinned + "+cu130")["torch_matches_pin"] is True
    assert stack_header("2.11.0+cu130")["torch_matches_pin"] is (pinned == "2.11.0")
    assert stack_header(pinned)["not_checked"] == list(NOT_CHECKED)
