"""What the policy losses read of their settings: the ``trainer.algorithm`` group as it is, under
SkyRL's nested names (``config.eps_clip_low``, ``config.sapo.tau_pos``,
``config.off_policy_correction.tis_ratio_type``, ...), as SkyRL hands its algorithm config to its
policy losses.

These are `typing.Protocol`s: `skylift.algorithms` sits beside `skylift.config` and does not import
it; at run time the object is the config's own ``AlgorithmConfig`` (or, in the Tinker service, one
built from a request's ``loss_fn_config``). The values are checked where the config is validated
(bounds beside the fields of ``skylift/config/algorithm.py``, combinations in
``skylift/config/validation.py``). A registered loss may read any other key of the group
(``config.loss_reduction``, ``config.policy_loss_type``, ...).
"""

from __future__ import annotations

from typing import Protocol

from skylift.algorithms.off_policy import OffPolicyCorrectionSettings


class CISPOSettings(Protocol):
    """``cispo``: CISPO's importance weights are clipped to ``[1 - low, 1 + high]``."""

    cispo_eps_clip_low: float
    cispo_eps_clip_high: float


class SAPOSettings(Protocol):
    """``sapo``: the gate temperatures of tokens with positive, resp. zero or negative, advantages."""

    tau_pos: float
    tau_neg: float


class ClipCovSettings(Protocol):
    """``clip_cov``: share of valid tokens dropped, drawn among those with covariance in (lb, ub)."""

    clip_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float


class KLCovSettings(Protocol):
    """``kl_cov``: share of valid tokens (largest covariance) penalised by ``ppo_kl_coef * |log r|``."""

    kl_cov_frac: float
    ppo_kl_coef: float


class DPPOSettings(Protocol):
    """``dppo``: the divergence (``binary_tv`` or ``binary_kl``) and its bounds for negative, resp.
    positive, advantages."""

    dppo_type: str
    delta_low: float
    delta_high: float


class PolicyLossSettings(Protocol):
    """What skylift's policy losses read of ``trainer.algorithm`` (each loss the keys it needs)."""

    eps_clip_low: float
    eps_clip_high: float
    clip_ratio_c: float
    use_tis: bool
    tis_imp_ratio_cap: float

    @property
    def cispo(self) -> CISPOSettings: ...
    @property
    def sapo(self) -> SAPOSettings: ...
    @property
    def clip_cov(self) -> ClipCovSettings: ...
    @property
    def kl_cov(self) -> KLCovSettings: ...
    @property
    def dppo(self) -> DPPOSettings: ...
    @property
    def off_policy_correction(self) -> OffPolicyCorrectionSettings: ...


def legacy_token_tis_cap(config: PolicyLossSettings) -> float | None:
    """The token TIS cap of ``use_tis`` / ``tis_imp_ratio_cap`` (skylift's and older SkyRL's
    spelling of ``off_policy_correction.tis_ratio_type=token``), or None when it is off."""
    return config.tis_imp_ratio_cap if config.use_tis else None
