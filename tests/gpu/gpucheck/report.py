"""Results of the check: named comparisons against stated limits, figures, and the JSON report.

Tolerances (`TOLERANCES`). float32 on the device must match float32 on CPU to within a fixed
limit: different kernels sum in different orders, nothing more. bfloat16 cannot be held to a fixed
limit (its rounding error depends on the model), so it is calibrated: the same configuration in
float32 on CPU is the reference's own measure of how far bfloat16 moves a number, and the device's
bfloat16 result may differ from the CPU's bfloat16 result by at most `BF16_FACTOR` times that,
plus the float32 limit. Two independent bfloat16 computations differ by about 1.4x it.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# float32 device vs float32 CPU
TOLERANCES = {
    "logprobs_abs": 1e-3,  # max |logprob difference| per token (nats), before and after the step
    "loss_rel": 1e-3,  # |loss difference| / max(|loss|, 1e-3)
    "grad_rel": 5e-3,  # ||g_device - g_cpu|| / ||g_cpu||, per parameter checked and for the total norm
}
BF16_FACTOR = 4.0


@dataclass
class Check:
    name: str
    value: float
    limit: float
    ok: bool
    note: str = ""


@dataclass
class Item:
    """One numbered check of the issue: its comparisons, its figures, and an error if it crashed."""

    key: str
    title: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    # the item cannot run on a machine like the GPU machine (an import it needs is missing): why
    skipped: str | None = None
    # the numbers of issue 50's items (what a first GPU run needs) that this check verifies
    verifies: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if self.skipped is not None:
            return self.error is None and all(c.ok for c in self.checks)
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    def at_most(self, name: str, value: float, limit: float, note: str = "") -> bool:
        ok = math.isfinite(value) and value <= limit
        self.checks.append(Check(name, float(value), float(limit), ok, note))
        return ok

    def holds(self, name: str, condition: bool, note: str = "") -> bool:
        self.checks.append(Check(name, 1.0 if condition else 0.0, 1.0, bool(condition), note))
        return bool(condition)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


@contextmanager
def running(item: Item) -> Iterator[Item]:
    """Time the item; an exception is recorded in it (the other items still run)."""
    started = time.perf_counter()
    try:
        yield item
    except Exception:
        item.error = traceback.format_exc(limit=12)
    finally:
        item.seconds = round(time.perf_counter() - started, 2)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero)."""
    diff = float((a.double() - b.double()).norm())
    base = float(b.double().norm())
    return diff / base if base > 0 else (0.0 if diff == 0 else math.inf)


def scalar_rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-3)


def limit_for(kind: str, calibration: float | None) -> float:
    """The limit of a comparison: fixed for float32, calibrated (see module doc) for bfloat16."""
    base = TOLERANCES[kind]
    return base if calibration is None else base + BF16_FACTOR * calibration


#: Issue 50's items: what the first GPU run needs.
ISSUE_50 = {
    "1": "weight sync chosen by where the ranks are (same GPU: CUDA IPC; NCCL refused there)",
    "2": "colocation that fits (trainer state offloaded while the engines are awake)",
    "3": "stream-safe receive (buffers handed back only when the consumer's loads are done)",
    "4": "set-up that yields the pinned CUDA stack",
    "5": "this check",
}


def issue_50_summary(items: list[Item], device: str) -> dict[str, Any]:
    """Per item of issue 50: the checks that verified it and whether they passed, on this device."""
    out: dict[str, Any] = {}
    for key, title in ISSUE_50.items():
        checks = [i for i in items if key in i.verifies]
        ran = [i for i in checks if i.skipped is None]
        if key == "5":
            status = "this report"
        elif not ran:
            status = "not verified by this run" + (" (skipped)" if checks else "")
        elif all(i.ok for i in ran):
            status = f"verified on {device}"
        else:
            status = "FAILED"
        out[key] = {"title": title, "status": status, "checks": [i.key for i in checks]}
    return out


def write_report(path: Path, header: dict[str, Any], items: list[Item]) -> dict[str, Any]:
    report = {
        **header,
        "tolerances": {**TOLERANCES, "bf16_factor": BF16_FACTOR},
        "ok": all(i.ok for i in items),
        "items": [i.to_json() for i in items],
        "issue_50": issue_50_summary(items, header.get("device", "?")),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    return report


def print_summary(report: dict[str, Any], say: Callable[[str], None] = print) -> None:
    say(f"GPU check on {report['device']} ({report['device_name']}): {report['seconds']:.0f} s")
    stack = report.get("stack")
    if stack:
        pinned = stack["pinned"]
        same = "the pinned one" if stack["torch_matches_pin"] else f"NOT the pinned {pinned['torch']}"
        say(
            f"  stack: torch {report['torch']} ({same}); skylift pins torch {pinned['torch']} + vLLM {pinned['vllm']}"
        )
        say("  not checked here (needs vLLM, Ray or the HTTP stack on the GPU machine):")
        for what in stack["not_checked"]:
            say(f"    - {what}")
    for item in report["items"]:
        failed = [c for c in item["checks"] if not c["ok"]]
        status = ("SKIPPED: " + item["skipped"]) if item.get("skipped") else "ok" if item["ok"] else "FAILED"
        say(
            f"  {item['key']} {item['title']}: {status} ({len(item['checks'])} checks, {item['seconds']:.1f} s)"
        )
        for c in failed:
            say(f"      failed: {c['name']} = {c['value']:.3g} (limit {c['limit']:.3g}) {c['note']}")
        if item["error"]:
            say("      error: " + item["error"].strip().splitlines()[-1])
        for key, value in item["figures"].items():
            if isinstance(value, int | float | str | bool):
                say(f"      {key}: {value}")
    for key, entry in report.get("issue_50", {}).items():
        checks = f" ({', '.join(entry['checks'])})" if entry["checks"] else ""
        say(f"  issue 50 item {key} ({entry['title']}): {entry['status']}{checks}")
    skipped = [i["key"] for i in report["items"] if i.get("skipped")]
    note = f" (items {', '.join(skipped)} SKIPPED: see above)" if skipped else ""
    say(f"report: {report['report_path']}  overall: {'PASS' if report['ok'] else 'FAIL'}{note}")
