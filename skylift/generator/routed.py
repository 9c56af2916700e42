"""Routing replay's side of a rollout (`generator.enable_return_routed_experts`): the experts the
engine routed each token of a trajectory to, aligned with its ids.

vLLM returns, with a finished sample, the routing of the tokens it ran through the model: row j is
token j of the request's prompt + sampled ids, for every token but the last sampled one (which was
never fed back) — `Completion.routed_experts`, [rows, layers, top_k]. A trajectory keeps
[len(prompt_ids) + len(response_ids), layers, top_k] (`Trajectory.routed_experts`), -1 where the
engine routed nothing: the last sampled token, the ids after the last turn (observations, the
template's turn close), the tail of a turn an environment rewrote. In a multi-turn rollout each turn's
request holds the whole context before it, so its routing covers every earlier token too; a later
turn's rows replace an earlier one's (the forward that sampled the later tokens saw those).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skylift.inference.types import Completion, EngineError

#: dtype of a trajectory's routing (-1 marks a token the engine did not route)
ROUTED_DTYPE = np.int16


def overlay(earlier: Any, later: Any, length: int) -> np.ndarray | None:
    """The routing of `length` tokens: `later`'s rows where it has them, else `earlier`'s, else -1
    (None when neither has any). `EngineError` when one has more rows than there are tokens."""
    given = [np.asarray(r) for r in (earlier, later) if r is not None]
    if not given:
        return None
    for routed in given:
        if routed.ndim != 3 or routed.shape[0] > length:
            raise EngineError(
                f"routing replay: the engine routed {routed.shape[0] if routed.ndim else 0} tokens "
                f"(shape {routed.shape}) but the sequence has {length} (want [<= {length}, layers, top_k])"
            )
    shape = given[-1].shape[1:]
    out = np.full((length, *shape), -1, dtype=ROUTED_DTYPE)
    for routed in given:
        if routed.shape[1:] != shape:
            raise EngineError(f"routing replay: turns routed in shapes {routed.shape[1:]} and {shape}")
        out[: routed.shape[0]] = routed
    return out


def routed_tokens(completion: Completion, length: int, required: bool) -> np.ndarray | None:
    """The routing of a sample's `length` tokens (its prompt and sampled ids); `EngineError` when
    `required` (routing replay is on) and the engine returned none."""
    if required and completion.routed_experts is None:
        raise EngineError(
            "generator.enable_return_routed_experts=true but the engine returned no routed experts "
            "(start it with vLLM's enable_return_routed_experts, a mixture-of-experts model, on CUDA)"
        )
    return overlay(None, completion.routed_experts, length)


__all__ = ["ROUTED_DTYPE", "overlay", "routed_tokens"]
