"""``trainer.dump_data_batch``: each step's training batch written to disk.

The batch the policy trains on at global step N (counted from 1) goes to
``<export_path>/dumped_data/global_step_N_training_input.pkl``: a `torch.save` file (pickle, hence
the ``.pkl`` name) holding only tensors, numbers and strings, so
``torch.load(path, weights_only=True)`` reads it back. Keys: ``input_ids``, ``attention_mask``,
``response_mask`` (``[B, P + R]`` / ``[B, R]``), ``prompt_len``, ``rewards`` (``[B]``), every
per-token or per-row tensor of the experience (``advantages``, ``rollout_logprobs``, ``old_logprobs``,
``ref_logprobs``, ``values``, ``returns`` where present) under ``extras``, and per row the
``uids`` (GRPO groups), ``data_sources`` and ``policy_versions``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from skylift.generator.trajectory import Trajectory
from skylift.rl.experience import Experience


def batch_dump_path(export_dir: Path, global_step: int) -> Path:
    """Where the batch trained at `global_step` (1-based) is written."""
    return export_dir / "dumped_data" / f"global_step_{global_step}_training_input.pkl"


def batch_record(experience: Experience, trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """What is written: the padded batch, its extras and rewards, and each row's ids."""
    batch = experience.batch
    return {
        "input_ids": batch.input_ids.detach().cpu(),
        "attention_mask": batch.attention_mask.detach().cpu(),
        "response_mask": batch.response_mask.detach().cpu(),
        "prompt_len": int(batch.prompt_len),
        "rewards": experience.rewards.detach().cpu(),
        "extras": {name: tensor.detach().cpu() for name, tensor in batch.extras.items()},
        "uids": [tr.uid for tr in trajectories],
        "data_sources": [tr.data_source for tr in trajectories],
        "policy_versions": [int(tr.policy_version) for tr in trajectories],
    }


def dump_training_batch(path: Path, experience: Experience, trajectories: Sequence[Trajectory]) -> None:
    """Write the batch to `path` whole (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(batch_record(experience, trajectories), tmp)
    os.replace(tmp, path)
