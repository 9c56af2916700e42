"""SkyRL's registries for custom advantage estimators and policy losses, over skylift's own.

A SkyRL user's module registers its functions with SkyRL's signatures::

    from skylift.compat.skyrl.registries import AdvantageEstimatorRegistry, register_policy_loss

    def simple_baseline(token_level_rewards, response_mask, index, **kwargs):
        ...
        return advantages, returns

    AdvantageEstimatorRegistry.register("simple_baseline", simple_baseline)

    @register_policy_loss("reinforce")
    def reinforce(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
        return (-log_probs * advantages).mean(), {"clip_ratio": 0.0}

and names the module in ``trainer.algorithm.import_modules``. Only the import line differs from
SkyRL (``skyrl.backends.skyrl_train.utils.ppo_utils`` there). How a SkyRL function is called here:

- **Estimators** get ``token_level_rewards`` and ``response_mask`` (``[batch, response_len]``; the
  outcome reward on each response's last token, KL-in-reward already subtracted), ``index`` (a
  numpy array of each sequence's prompt uid: equal uids form a group), ``values`` (critic values or
  None), ``grpo_norm_by_std``, ``gamma``, ``lambd`` and ``config=None`` (skylift passes the settings
  an estimator reads as the arguments above). They return ``(advantages, returns)``.
- **Losses** get ``log_probs``, ``old_log_probs``, ``advantages``, ``config`` (the
  ``trainer.algorithm`` group as it is, as SkyRL passes it: ``config.eps_clip_low``,
  ``config.clip_ratio_c``, ``config.sapo.tau_pos``, ``config.off_policy_correction.tis_ratio_type``,
  ``config.loss_reduction``, ... under SkyRL's names), ``loss_mask``
  and ``rollout_logprobs=None`` (off-policy corrections are applied after the loss, as for every
  skylift loss). They return ``(loss, metrics)``: ``loss`` is per token (``[batch, response_len]``)
  or one number for the micro-batch, which counts as that value on each of its valid tokens before
  ``trainer.algorithm.loss_reduction`` reduces it (with ``token_mean`` and one micro-batch per
  mini-batch: exactly that number). ``metrics`` is a dict of numbers, or one number taken as
  ``clip_ratio`` (SkyRL's older return value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from skylift.algorithms.advantages import (
    AdvantageEstimator,
    GroupIds,
    TokenRewards,
    advantage_estimator_names,
    get_advantage_estimator,
    token_level_estimator,
    unregister_advantage_estimator,
)
from skylift.algorithms.advantages import (
    register_advantage_estimator as _register_estimator,
)
from skylift.algorithms.loss_settings import PolicyLossSettings
from skylift.algorithms.policy_loss import (
    LossInputs,
    PolicyLoss,
    get_policy_loss,
    policy_loss_from,
    policy_loss_names,
    unregister_policy_loss,
)
from skylift.algorithms.policy_loss import (
    register_policy_loss as _register_loss,
)

SkyRLFunction = Callable[..., Any]


def _group_index(group_ids: GroupIds | None, batch: int) -> np.ndarray:
    if group_ids is None:
        return np.arange(batch).astype(str).astype(object)
    if isinstance(group_ids, torch.Tensor):
        return group_ids.detach().cpu().numpy()
    return np.asarray(list(group_ids), dtype=object)


def _returned_pair(fn: SkyRLFunction, out: object, kind: str, pair: str) -> tuple[Any, Any]:
    """What the SkyRL function `fn` (a `kind`) returned, which must be the 2-tuple ``(pair)``;
    anything else raises naming `fn`."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{kind} {fn.__name__!r} must return ({pair}), got {type(out).__name__}")
    return out


Call = TypeVar("Call", bound=Callable[..., Any])


def _named_like(fn: SkyRLFunction, call: Call) -> Call:
    """`call` (the adapter of the SkyRL function `fn`) under `fn`'s name and docstring."""
    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "skyrl_function")
    call.__doc__ = fn.__doc__
    return call


def _as_estimator(fn: SkyRLFunction) -> AdvantageEstimator:
    def skyrl_call(batch: TokenRewards) -> tuple[torch.Tensor, torch.Tensor]:
        response_mask = batch.response_mask
        out = fn(
            token_level_rewards=batch.token_level_rewards,
            response_mask=response_mask,
            index=_group_index(batch.group_ids, response_mask.shape[0]),
            values=batch.values,
            grpo_norm_by_std=batch.norm_by_std,
            gamma=batch.gamma,
            lambd=batch.lambd,
            config=None,
        )
        advantages, returns = _returned_pair(fn, out, "advantage estimator", "advantages, returns")
        for what, tensor in (("advantages", advantages), ("returns", returns)):
            if not isinstance(tensor, torch.Tensor) or tensor.shape != response_mask.shape:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(
                    f"advantage estimator {fn.__name__!r} returned {what} of shape {shape}; expected "
                    f"{tuple(response_mask.shape)} like response_mask"
                )
        return advantages * response_mask, returns * response_mask

    return token_level_estimator(_named_like(fn, skyrl_call))


def _as_policy_loss(fn: SkyRLFunction) -> PolicyLoss:
    def skyrl_call(x: LossInputs, config: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, float]]:
        out = fn(
            x.logprobs,
            x.old_logprobs,
            x.advantages,
            config=config,
            loss_mask=x.response_mask,
            rollout_logprobs=None,
        )
        value, raw = _returned_pair(fn, out, "policy loss", "loss, metrics")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"policy loss {fn.__name__!r} returned a {type(value).__name__}, not a tensor")
        if value.dim() == 0:
            per_token = value.expand_as(x.logprobs)
        elif value.shape == x.logprobs.shape:
            per_token = value
        else:
            raise ValueError(
                f"policy loss {fn.__name__!r} returned a loss of shape {tuple(value.shape)}; expected one "
                f"number or {tuple(x.logprobs.shape)} (one per token)"
            )
        items = raw.items() if isinstance(raw, dict) else [("clip_ratio", raw)]
        return per_token, {str(k): float(v) for k, v in items}

    return policy_loss_from(_named_like(fn, skyrl_call))


@dataclass(frozen=True)
class SkyRLRegistry:
    """SkyRL's registry API (``register``, ``get``, ``list_available``, ``unregister``) over one of
    skylift's registries: `adapt` makes a function with SkyRL's signature a skylift one; `add`,
    `lookup`, `names` and `remove` are the skylift registry's functions."""

    adapt: Callable[[SkyRLFunction], Any]
    add: Callable[[str], Callable[[Any], Any]]
    lookup: Callable[[str], Callable[..., Any]]
    names: Callable[[], list[str]]
    remove: Callable[[str], None]

    def register(self, name: str, func: SkyRLFunction) -> None:
        """Register `func` (with SkyRL's signature for this kind) as `name`; a taken name raises."""
        self.add(str(name))(self.adapt(func))

    def get(self, name: str) -> Callable[..., Any]:
        return self.lookup(str(name))

    def list_available(self) -> list[str]:
        return self.names()

    def unregister(self, name: str) -> None:
        self.remove(str(name))

    def decorator(self, name: str) -> Callable[[SkyRLFunction], SkyRLFunction]:
        """SkyRL's ``register_*`` decorator: registers the function as `name`; returns it unchanged."""

        def register(fn: SkyRLFunction) -> SkyRLFunction:
            self.register(name, fn)
            return fn

        return register


AdvantageEstimatorRegistry = SkyRLRegistry(
    _as_estimator,
    _register_estimator,
    get_advantage_estimator,
    advantage_estimator_names,
    unregister_advantage_estimator,
)
"""SkyRL's ``AdvantageEstimatorRegistry`` over skylift's estimator registry."""

PolicyLossRegistry = SkyRLRegistry(
    _as_policy_loss, _register_loss, get_policy_loss, policy_loss_names, unregister_policy_loss
)
"""SkyRL's ``PolicyLossRegistry`` over skylift's policy-loss registry."""


def register_advantage_estimator(name: str) -> Callable[[SkyRLFunction], SkyRLFunction]:
    """SkyRL's decorator: registers a function with SkyRL's estimator signature; returns it unchanged."""
    return AdvantageEstimatorRegistry.decorator(name)


def register_policy_loss(name: str) -> Callable[[SkyRLFunction], SkyRLFunction]:
    """SkyRL's decorator: registers a function with SkyRL's policy-loss signature; returns it unchanged."""
    return PolicyLossRegistry.decorator(name)
