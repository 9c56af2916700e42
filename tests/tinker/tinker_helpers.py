"""Small data builders shared by the Tinker tests."""

from __future__ import annotations

import numpy as np
from tinker import types


def datum(tokens: list[int], weights: list[float] | None = None, **inputs: np.ndarray) -> types.Datum:
    """Next-token datum: input tokens[:-1], targets tokens[1:] (weights default to 1)."""
    n = len(tokens) - 1
    w = np.ones(n, dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)
    loss_inputs = {"target_tokens": np.asarray(tokens[1:], dtype=np.int64), **inputs}
    if "advantages" not in inputs:
        loss_inputs["weights"] = w
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_inputs)


def sft_dataset() -> list[types.Datum]:
    """A fixed small dataset: four short repeating token patterns."""
    rows = [[5 + (i * 7 + j * 3) % 40 for j in range(24)] for i in range(4)]
    return [datum(r) for r in rows]


def logprobs_of(output, i: int = 0) -> np.ndarray:
    return np.asarray(output.loss_fn_outputs[i]["logprobs"].data, dtype=np.float64)
