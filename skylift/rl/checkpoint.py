"""Atomic, resumable checkpoints.

Layout: `<ckpt_path>/global_step_<N>/` holding `policy/` (sharded model + optimizer, written by the
workers), `trainer_state.json`, and `COMPLETE`, written last. A checkpoint is first written to
`global_step_<N>.partial` and renamed when complete, so a crash mid-write never leaves a directory
that resume could pick. The trainer state holds the step, the policy version and where the rollout
source is in the data (`TrainerState.rollouts`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


@dataclass
class TrainerState:
    global_step: int = 0  # training steps completed
    epoch: int = 0
    step_in_epoch: int = 0  # batches of `epoch` already consumed
    policy_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    #: the rollout source's place in the data (`RolloutSource.state`: a fully async run's pending
    #: prompts), so a resumed run neither repeats nor skips a prompt
    rollouts: dict[str, Any] = field(default_factory=dict)


def step_dir(ckpt_path: str | Path, step: int) -> Path:
    return Path(ckpt_path) / f"global_step_{step}"


def partial_dir(ckpt_path: str | Path, step: int) -> Path:
    return Path(ckpt_path) / f"global_step_{step}.partial"


def begin_checkpoint(ckpt_path: str | Path, step: int) -> Path:
    """A fresh `.partial` directory to write step `step` into."""
    tmp = partial_dir(ckpt_path, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(ckpt_path: str | Path, step: int, state: TrainerState, max_to_keep: int = -1) -> Path:
    """Write the trainer state and the marker, then rename `.partial` into place."""
    tmp = partial_dir(ckpt_path, step)
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    final = step_dir(ckpt_path, step)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    (Path(ckpt_path) / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    if max_to_keep > 0:
        for old in list_checkpoints(ckpt_path)[:-max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_path: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(ckpt_path)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(ckpt_path: str | Path) -> Path | None:
    found = list_checkpoints(ckpt_path)
    return found[-1] if found else None


def load_trainer_state(checkpoint: str | Path) -> TrainerState:
    path = Path(checkpoint)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete skylift checkpoint (no {COMPLETE_MARKER} marker)")
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))
