"""Advantage estimators (`grpo`, `rloo`, `maxrl`, `reinforce++`, `gae`, `no_op`) behind a registry users can extend.

Conventions (all tensors batch-first):

- Rewards come per sequence (``[batch]``: the environment's outcome reward) or per token
  (``[batch, response_len]``, where KL-in-reward subtracts a per-token penalty,
  `skylift.algorithms.kl.apply_kl_penalty`). A per-token reward tensor holds an outcome reward on the
  **last valid token** of its response (the last position where ``response_mask`` is 1) and 0
  elsewhere; `sequence_rewards_to_token_level` builds it.
- ``response_mask``: ``[batch, response_len]`` float, 1 for tokens the policy produced and that count.
  Masked positions (padding, or environment tokens inside a multi-turn response) get advantage and
  return 0, and their rewards are ignored. A row with no valid token scores 0.
- Sequence-level estimators (``grpo``, ``rloo``, registered with ``sequence_level=True``) work on one
  score per sequence: the sequence reward, or the sum of the row's valid token rewards. They
  broadcast the sequence advantage to all its valid tokens. Token-level estimators
  (``reinforce++``, ``gae``) walk the valid tokens backwards (per-sequence rewards are first put on
  each row's last valid token); masked positions are skipped (the discount only counts valid tokens).
- Every estimator returns ``(advantages, returns)``, both ``[batch, response_len]`` and 0 on masked
  positions. For ``grpo``/``rloo``/``reinforce++`` returns are the quantities the advantages came from
  (sequence advantages, resp. discounted returns); for ``gae`` they are the critic's value targets.

Add an estimator with::

    @register_advantage_estimator("my_estimator")  # token level
    def my_estimator(*, token_level_rewards, response_mask, group_ids, values, gamma, lambd,
                     norm_by_std, eps): ...

    @register_advantage_estimator("my_outcome_estimator", sequence_level=True)
    def my_outcome_estimator(*, sequence_rewards, response_mask, group_ids, norm_by_std, eps): ...
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from skylift.algorithms.reductions import masked_mean, masked_sum
from skylift.utils.registry import ADVANTAGE_ESTIMATOR_REGISTRY, Registry

GroupIds = Sequence[Hashable] | torch.Tensor


class AdvantageEstimator(Protocol):
    """A token-level advantage estimator: keyword arguments as in `compute_advantages` with
    `[batch, response_len]` rewards; returns (advantages, returns)."""

    def __call__(
        self,
        *,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: GroupIds | None,
        values: torch.Tensor | None,
        gamma: float,
        lambd: float,
        norm_by_std: bool,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class SequenceAdvantageEstimator(Protocol):
    """A sequence-level advantage estimator: one score per sequence (`sequence_rewards`, `[batch]`)
    in, (advantages, returns) `[batch, response_len]` out."""

    def __call__(
        self,
        *,
        sequence_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: GroupIds | None,
        norm_by_std: bool,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


Estimator = AdvantageEstimator | SequenceAdvantageEstimator

_ESTIMATORS: Registry[Estimator] = ADVANTAGE_ESTIMATOR_REGISTRY
_SEQUENCE_LEVEL: set[str] = set()


def register_advantage_estimator(
    name: str, *, override: bool = False, sequence_level: bool = False
) -> Callable[[Estimator], Estimator]:
    """Decorator registering an advantage estimator under `name` (`override=True` to replace one).

    `sequence_level=True`: the estimator takes one score per sequence (`sequence_rewards`) instead
    of per-token rewards (see `SequenceAdvantageEstimator`).
    """
    register = _ESTIMATORS.register(name, override=override)

    def decorator(fn: Estimator) -> Estimator:
        register(fn)
        (_SEQUENCE_LEVEL.add if sequence_level else _SEQUENCE_LEVEL.discard)(name)
        return fn

    return decorator


def unregister_advantage_estimator(name: str) -> None:
    """Remove the estimator registered as `name`."""
    _ESTIMATORS.unregister(name)
    _SEQUENCE_LEVEL.discard(name)


def is_sequence_level(name: str) -> bool:
    """Whether the estimator registered as `name` works on one score per sequence."""
    _ESTIMATORS.get(name)  # unknown names raise, listing the known ones
    return name in _SEQUENCE_LEVEL


def get_advantage_estimator(name: str) -> Estimator:
    """The estimator registered as `name`; an unknown name raises an error listing the known ones."""
    return _ESTIMATORS.get(name)


def advantage_estimator_names() -> list[str]:
    """Names of all registered advantage estimators."""
    return _ESTIMATORS.names()


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, both `[batch, response_len]`, from the estimator registered as `name`.

    `rewards`: one per sequence (`[batch]`) or per token (`[batch, response_len]`). A sequence-level
    estimator gets per-sequence scores (a per-token tensor is summed over each row's valid tokens), a
    token-level one per-token rewards (a sequence reward goes on the row's last valid token).
    `group_ids` (one hashable per sequence, e.g. the prompt uid) is required by `grpo` and `rloo`;
    `values` (critic values per response token) by `gae`. `norm_by_std`: `grpo` divides by the group
    std, `gae` whitens the advantages over the batch; `rloo` ignores it and `reinforce++` always whitens.
    """
    if response_mask.dim() != 2:
        raise ValueError(
            f"response_mask must be [batch, response_len], got shape {tuple(response_mask.shape)}"
        )
    if rewards.shape not in (response_mask.shape, response_mask.shape[:1]):
        raise ValueError(
            f"rewards must be [batch] or [batch, response_len] = {tuple(response_mask.shape)} like "
            f"response_mask, got shape {tuple(rewards.shape)}"
        )
    estimator = get_advantage_estimator(name)
    rewards = rewards.detach() if rewards.is_floating_point() else rewards.float()
    mask = response_mask.detach().to(rewards.dtype)
    with torch.no_grad():
        if is_sequence_level(name):
            if rewards.dim() == 2:
                scores = masked_sum(rewards, mask, dim=-1)
            else:  # a row without a valid token carries no reward (as on the token level)
                scores = torch.where((mask != 0).any(dim=-1), rewards, torch.zeros_like(rewards))
            return estimator(  # type: ignore[call-arg]
                sequence_rewards=scores,
                response_mask=mask,
                group_ids=group_ids,
                norm_by_std=norm_by_std,
                eps=eps,
            )
        token_rewards = rewards if rewards.dim() == 2 else sequence_rewards_to_token_level(rewards, mask)
        return estimator(  # type: ignore[call-arg]
            token_level_rewards=token_rewards,
            response_mask=mask,
            group_ids=group_ids,
            values=None if values is None else values.detach(),
            gamma=gamma,
            lambd=lambd,
            norm_by_std=norm_by_std,
            eps=eps,
        )


def sequence_rewards_to_token_level(
    rewards: torch.Tensor | Sequence[float], response_mask: torch.Tensor
) -> torch.Tensor:
    """`[batch, response_len]` tensor holding each sequence reward on its last valid token, 0 elsewhere.

    A row with no valid token gets no reward at all.
    """
    if response_mask.dim() != 2:
        raise ValueError(
            f"response_mask must be [batch, response_len], got shape {tuple(response_mask.shape)}"
        )
    rewards_t = torch.as_tensor(rewards, dtype=torch.float32 if not torch.is_tensor(rewards) else None)
    if not rewards_t.is_floating_point():
        rewards_t = rewards_t.float()
    if rewards_t.shape != (response_mask.shape[0],):
        raise ValueError(f"rewards must have shape ({response_mask.shape[0]},), got {tuple(rewards_t.shape)}")
    valid = response_mask != 0
    length = response_mask.shape[1]
    positions = torch.arange(length, device=response_mask.device).expand_as(response_mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(response_mask.shape, dtype=rewards_t.dtype, device=response_mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards_t.to(out.device)[rows]
    return out


def _group_index(group_ids: GroupIds | None, batch: int, estimator: str) -> tuple[torch.Tensor, int]:
    """Dense group index per sequence (0..n_groups-1) and the number of groups."""
    if group_ids is None:
        raise ValueError(f"advantage estimator {estimator!r} needs group_ids (one id per sequence)")
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch} sequences")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(gid, len(dense)) for gid in ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def _group_stats(scores: torch.Tensor, group_ids: GroupIds | None, estimator: str) -> GroupScores:
    """Each sequence's score with its group's size, sum and unbiased std (std 0 for groups of size 1)."""
    index, n_groups = _group_index(group_ids, scores.shape[0], estimator)
    index = index.to(scores.device)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, index, torch.ones_like(scores)
    )
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, scores)
    means = sums / counts
    sq_dev = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, index, (scores - means[index]).square()
    )
    stds = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    return GroupScores(scores, counts[index], sums[index], stds[index])


def _per_token(adv: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence-level advantage on each of its response tokens: (advantages, returns), equal."""
    adv_tokens = adv.unsqueeze(-1) * response_mask
    return adv_tokens, adv_tokens.clone()


def _discounted_backward(
    mask: torch.Tensor,
    step: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Backward recursion over valid tokens: ``carry = step(t, carry)`` where valid, unchanged elsewhere.

    Returns the carry at every valid position (0 on masked positions).
    """
    batch, length = mask.shape
    out = torch.zeros_like(mask)
    carry = torch.zeros(batch, dtype=mask.dtype, device=mask.device)
    for t in reversed(range(length)):
        valid = mask[:, t] != 0
        carry = torch.where(valid, step(t, carry), carry)
        out[:, t] = torch.where(valid, carry, torch.zeros_like(carry))
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the valid positions (unbiased std; 0 with fewer than 2)."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = masked_sum((values - mean).square(), mask) / (count - 1).clamp(min=1)
    whitened = (values - mean) / (var.sqrt() + eps)
    return torch.where(mask != 0, whitened, torch.zeros_like(whitened))


@dataclass(frozen=True)
class GroupScores:
    """Each sequence's score with its group's size, sum and unbiased std (all `[batch]`; the std is 0
    in a group of one sequence)."""

    scores: torch.Tensor
    counts: torch.Tensor
    sums: torch.Tensor
    stds: torch.Tensor

    @property
    def means(self) -> torch.Tensor:
        return self.sums / self.counts


GroupAdvantage = Callable[[GroupScores, bool, float], torch.Tensor]
"""A group-relative estimator's rule: `(group, norm_by_std, eps)` to each sequence's advantage."""


def _register_group_estimator(name: str) -> Callable[[GroupAdvantage], SequenceAdvantageEstimator]:
    """Decorator registering the sequence-level estimator `name` whose advantage of a sequence comes
    from its score and its group's statistics (`group_ids` required); the estimator puts it on each
    valid token (advantages and returns equal). Returns the registered estimator."""

    def decorator(advantage: GroupAdvantage) -> SequenceAdvantageEstimator:
        def estimator(
            *,
            sequence_rewards: torch.Tensor,
            response_mask: torch.Tensor,
            group_ids: GroupIds | None,
            norm_by_std: bool = True,
            eps: float = 1e-6,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            group = _group_stats(sequence_rewards, group_ids, name)
            return _per_token(advantage(group, norm_by_std, eps), response_mask)

        estimator.__name__ = estimator.__qualname__ = advantage.__name__
        estimator.__doc__ = advantage.__doc__
        register_advantage_estimator(name, sequence_level=True)(estimator)
        return estimator

    return decorator


@_register_group_estimator("grpo")
def grpo_advantages(group: GroupScores, norm_by_std: bool, eps: float) -> torch.Tensor:
    """Group-relative advantage ``(score - group_mean) / (group_std + eps)`` (no division without
    `norm_by_std`), with the unbiased group std. A group of one sequence, or of equal scores, gives 0."""
    adv = group.scores - group.means
    return adv / (group.stds + eps) if norm_by_std else adv


@_register_group_estimator("rloo")
def rloo_advantages(group: GroupScores, norm_by_std: bool, eps: float) -> torch.Tensor:
    """Leave-one-out baseline: ``score_i - mean(scores of the other members of i's group)``.

    A group of one sequence has no other member and gets advantage 0.
    """
    scores, counts = group.scores, group.counts
    baseline = (group.sums - scores) / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, scores - baseline, torch.zeros_like(scores))


@_register_group_estimator("maxrl")
def maxrl_advantages(group: GroupScores, norm_by_std: bool, eps: float) -> torch.Tensor:
    """MaxRL (``advantage_estimator=maxrl``): ``(score - group_mean) / (group_mean + eps)``, the group-centred
    reward divided by the group's mean reward (its success rate with 0/1 rewards) instead of its
    std. A group of one sequence keeps its score as its advantage; `norm_by_std` is
    not read."""
    means = group.means
    return torch.where(group.counts > 1, (group.scores - means) / (means + eps), group.scores)


@dataclass(frozen=True)
class TokenRewards:
    """What a token-level estimator reads: the keyword arguments of `AdvantageEstimator` as one value,
    with `compute_advantages`'s defaults."""

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: GroupIds | None = None
    values: torch.Tensor | None = None
    gamma: float = 1.0
    lambd: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6


TokenAdvantage = Callable[[TokenRewards], tuple[torch.Tensor, torch.Tensor]]
"""A token-level estimator's rule: the batch's `TokenRewards` to (advantages, returns)."""


def token_level_estimator(rule: TokenAdvantage) -> AdvantageEstimator:
    """`rule` as an `AdvantageEstimator`: the estimator takes the registry's keyword arguments (the
    fields of `TokenRewards`; an unknown one raises) and hands them to `rule` as one `TokenRewards`."""

    def estimator(**arguments: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return rule(TokenRewards(**arguments))

    estimator.__name__ = estimator.__qualname__ = getattr(rule, "__name__", "token_level_estimator")
    estimator.__doc__ = rule.__doc__
    return estimator


def _register_token_estimator(name: str) -> Callable[[TokenAdvantage], AdvantageEstimator]:
    """Decorator registering `rule` as the token-level estimator `name` (see `token_level_estimator`)."""

    def decorator(rule: TokenAdvantage) -> AdvantageEstimator:
        estimator = token_level_estimator(rule)
        register_advantage_estimator(name)(estimator)
        return estimator

    return decorator


@_register_token_estimator("reinforce++")
def reinforce_plus_plus_advantages(batch: TokenRewards) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return ``G_t = r_t + gamma * G_{t+1}`` over valid tokens, then the
    advantages are the returns whitened over all valid tokens of the batch."""
    rewards, mask, gamma = batch.token_level_rewards, batch.response_mask, batch.gamma
    returns = _discounted_backward(mask, lambda t, carry: rewards[:, t] + gamma * carry)
    return masked_whiten(returns, mask, batch.eps), returns


@_register_token_estimator("gae")
def gae_advantages(batch: TokenRewards) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with critic `values` (``V_t`` per response token).

    ``delta_t = r_t + gamma * V_next - V_t`` (``V_next`` the value at the next valid token, 0 after the
    last), ``A_t = delta_t + gamma * lambd * A_next``; returns (value targets) ``A_t + V_t`` before any
    whitening; advantages are whitened over the batch when `norm_by_std`.
    """
    rewards, response_mask, gamma = batch.token_level_rewards, batch.response_mask, batch.gamma
    if batch.values is None:
        raise ValueError("advantage estimator 'gae' needs values (critic values per response token)")
    if batch.values.shape != rewards.shape:
        raise ValueError(
            f"values shape {tuple(batch.values.shape)} != token_level_rewards shape {tuple(rewards.shape)}"
        )
    values = batch.values.to(rewards.dtype)
    size, length = response_mask.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(size, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(length)):
        valid = response_mask[:, t] != 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * batch.lambd * next_adv
        next_adv = torch.where(valid, adv_t, next_adv)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = torch.where(valid, adv_t, torch.zeros_like(adv_t))
    returns = torch.where(response_mask != 0, advantages + values, torch.zeros_like(values))
    if batch.norm_by_std:
        advantages = masked_whiten(advantages, response_mask, batch.eps)
    return advantages, returns


@_register_token_estimator("no_op")
def no_op_advantages(batch: TokenRewards) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's reward is its advantage and its return (on-policy distillation, where the
    per-token reward is already the signal: ``trainer.algorithm.on_policy_distillation``)."""
    advantages = batch.token_level_rewards * batch.response_mask
    return advantages, advantages.clone()
