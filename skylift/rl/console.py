"""What a training run prints: `[skylift]` lines, a progress bar and one summary line per step.

The bar is drawn on a terminal only; in a log file the step lines say the same.
"""

from __future__ import annotations

import sys
from typing import Any


class Console:
    """Progress output of a run; `enabled=False` prints nothing (tests, benchmarks' children)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar: Any = None

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"[skylift] {text}", flush=True)

    def start_progress(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total,
            initial=done,
            desc="training",
            unit="step",
            disable=not (self.enabled and sys.stderr.isatty()),
            dynamic_ncols=True,
        )

    def step_done(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.update(1)
        if self.enabled:
            line = step_summary(step, total, metrics)
            if self._bar is not None and not self._bar.disable:
                self._bar.write(line)
            else:
                print(line, flush=True)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def step_summary(step: int, total: int, m: dict[str, float]) -> str:
    """`step 3/20 | reward 0.250 | ... | gen 1.2s wait ... idle 0.1s`: the figures a step has."""
    parts = [f"step {step}/{total}", f"reward {m['reward/mean']:.3f}"]
    if "eval/accuracy" in m:
        stderr = f" ± {m['eval/accuracy_stderr']:.3f}" if "eval/accuracy_stderr" in m else ""
        parts.append(f"eval acc {m['eval/accuracy']:.3f}{stderr}")
    parts.append(f"resp len {m['response_length/mean']:.1f}")
    if "policy/kl_loss" in m:
        parts.append(f"kl {m['policy/kl_loss']:.4f}")
    if "policy/logprob_diff_vs_rollout" in m:
        parts.append(f"|lp diff| {m['policy/logprob_diff_vs_rollout']:.1e}")
    if "policy/routing_differs" in m:  # routing replay: the share of routings it overrode
        parts.append(f"replayed routing differs {m['policy/routing_differs']:.2%}")
    if "engines/live" in m:
        parts.append(f"engines live {m['engines/live']:.0f}")
    if m.get("async/staleness_max", 0.0) > 0:
        parts.append(f"staleness {m['async/staleness_max']:.0f}")
    parts.append(
        f"gen {m['timing/generate_s']:.1f}s wait {m['timing/wait_s']:.1f}s train {m['timing/train_s']:.1f}s "
        f"sync {m['timing/weight_sync_s']:.1f}s{sync_detail(m)} idle {m['timing/idle_s']:.1f}s"
    )
    return " | ".join(parts)


def sync_detail(m: dict[str, float]) -> str:
    """` (ipc 270 MB)`: the transport and what it moved, where the step's sync pushed weights."""
    via = [key.rsplit("/", 1)[1] for key in m if key.startswith("weight_sync/via/")]
    if not via:
        return ""
    mb = m.get("weight_sync/bytes", -1.0) / 1e6
    moved = "" if mb < 0 else f" {mb:.1f} MB" if mb < 10 else f" {mb:.0f} MB"
    return f" ({via[0]}{moved})"
