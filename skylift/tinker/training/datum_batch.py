"""Tinker datums as a training `SequenceBatch`, and the Tinker losses as worker `LossFn`s.

A datum is ``model_input`` tokens ``x[0..N)`` with per-position ``loss_fn_inputs``: position ``i``
scores ``target_tokens[i]`` (one token, or K tokens for 2-D targets) after ``x[0..i]``. In the
worker's layout that is prompt ``x[0]`` and response ``x[1..N) + [t]`` (``t`` is never fed to a
position that is scored), with the targets as the ``target_ids`` extra, so response position
``i`` is exactly datum position ``i``. Other inputs (weights, advantages, ...) become `[B, N]`
extras; ``tinker_row`` keeps each row's index through the worker's length-sorted micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from skylift.tinker.core.wire import WireDatum
from skylift.tinker.training.losses import LossSpec
from skylift.worker.batch import SequenceBatch

ROW = "tinker_row"
TARGETS = "target_ids"


def datums_to_batch(data: Sequence[WireDatum], names: Sequence[str], two_d: bool) -> SequenceBatch:
    """Pad `data` into a batch; `names` are the float loss inputs every datum carries."""
    b, n = len(data), max(len(d.tokens) for d in data)
    k = max(int(d.inputs["target_tokens"].shape[1]) for d in data) if two_d else 0
    ids = torch.zeros((b, n + 1), dtype=torch.long)
    attention = torch.zeros((b, n + 1), dtype=torch.long)
    mask = torch.zeros((b, n), dtype=torch.float32)
    targets = torch.zeros((b, n, k) if two_d else (b, n), dtype=torch.long)
    extras = {name: torch.zeros(targets.shape, dtype=torch.float32) for name in names}
    rows: list[dict[str, Tensor]] = []
    for j, d in enumerate(data):
        m = len(d.tokens)
        t = torch.as_tensor(d.inputs["target_tokens"].astype(np.int64))
        ids[j, :m] = torch.as_tensor(d.tokens, dtype=torch.long)
        ids[j, m] = t.reshape(m, -1)[-1, 0]
        attention[j, : m + 1] = 1
        mask[j, :m] = 1.0
        targets[j, :m] = t
        for name in names:
            value = torch.as_tensor(d.inputs[name].astype(np.float32))
            extras[name][j, :m] = value.unsqueeze(-1) if (two_d and value.dim() == 1) else value
        vision = {}
        if d.pixel_values is not None:
            vision = {"pixel_values": d.pixel_values, "image_grid_thw": d.image_grid_thw}
        rows.append(vision)
    extras[TARGETS] = targets
    extras[ROW] = torch.arange(b)
    has_images = any(rows)
    return SequenceBatch(ids, attention, mask, 1, extras, row_inputs=rows if has_images else None)


@dataclass
class TinkerLoss:
    """A Tinker loss as a worker `LossFn` that also keeps each row's logprobs and per-token loss."""

    spec: LossSpec
    names: Sequence[str]
    config: dict[str, float | str]
    total: float = 0.0
    logprobs: dict[int, np.ndarray] = field(default_factory=dict)
    per_token: dict[int, np.ndarray] = field(default_factory=dict)

    def __call__(self, logp: Tensor, micro: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
        mask = micro.response_mask
        inputs = {name: micro.extras[name] for name in self.names}
        per_token, metrics = self.spec.impl(logp, inputs, mask, self.config)
        loss = per_token.sum()
        self.total += float(loss.detach())
        lp, pt = logp.detach().float().cpu().numpy(), per_token.detach().float().cpu().numpy()
        for j, row in enumerate(micro.extras[ROW].tolist()):
            self.logprobs[row], self.per_token[row] = lp[j], pt[j]
        return loss, metrics
