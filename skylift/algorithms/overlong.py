"""DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13).

A response of ``L`` tokens with a budget of ``L_max`` tokens and a buffer of ``L_cache`` tokens:

- ``L <= L_max - L_cache``: reward unchanged;
- ``L_max - L_cache < L <= L_max``: reward minus ``(L - (L_max - L_cache)) / L_cache * factor``
  (0 at the start of the buffer, ``factor`` at ``L_max``);
- ``L > L_max`` (a multi-turn response can outgrow the per-turn budget): reward 0.
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_rewards(
    rewards: Sequence[float], lengths: Sequence[int], max_len: int, buffer_len: int, factor: float
) -> list[float]:
    """The rewards after the soft overlong punishment (``buffer_len`` 0 leaves them unchanged)."""
    if len(rewards) != len(lengths):
        raise ValueError(f"{len(rewards)} rewards for {len(lengths)} response lengths")
    if buffer_len <= 0:
        return list(rewards)
    if buffer_len > max_len:
        raise ValueError(f"overlong buffer of {buffer_len} tokens is longer than the {max_len}-token budget")
    start = max_len - buffer_len
    out = []
    for reward, length in zip(rewards, lengths, strict=True):
        if length > max_len:
            out.append(0.0)
        elif length > start:
            out.append(reward - (length - start) / buffer_len * factor)
        else:
            out.append(reward)
    return out
