"""RL algorithm math for the trainer: advantage estimators, policy losses, KL terms, loss reductions.

Pure PyTorch, batch-first `[batch, response_len]` tensors with a float mask (1 = token counts).
"""

from skylift.algorithms import covariance_losses as _covariance_losses  # registers clip_cov, kl_cov
from skylift.algorithms import divergence_losses as _divergence_losses  # registers dppo
from skylift.algorithms.advantages import (
    AdvantageEstimator,
    SequenceAdvantageEstimator,
    advantage_estimator_names,
    compute_advantages,
    get_advantage_estimator,
    is_sequence_level,
    masked_whiten,
    register_advantage_estimator,
    sequence_rewards_to_token_level,
    unregister_advantage_estimator,
)
from skylift.algorithms.kl import (
    KL_CTRL_TYPES,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    compute_kl,
    make_kl_controller,
)
from skylift.algorithms.loss_settings import PolicyLossSettings
from skylift.algorithms.off_policy import OffPolicyCorrectionSettings, apply_off_policy_correction
from skylift.algorithms.policy_loss import (
    ROLLOUT_ANCHORED,
    ROLLOUT_PREFERRED,
    PolicyLoss,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
    unregister_policy_loss,
)
from skylift.algorithms.reductions import (
    LOSS_REDUCTIONS,
    MiniBatchTotals,
    masked_mean,
    masked_sum,
    mini_batch_totals,
    reduce_loss,
)
from skylift.algorithms.value_loss import compute_value_loss
from skylift.utils.registry import UnknownNameError

del _covariance_losses, _divergence_losses

__all__ = [
    "KL_CTRL_TYPES",
    "KL_ESTIMATORS",
    "LOSS_REDUCTIONS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "KLController",
    "ROLLOUT_ANCHORED",
    "ROLLOUT_PREFERRED",
    "MiniBatchTotals",
    "OffPolicyCorrectionSettings",
    "PolicyLoss",
    "PolicyLossSettings",
    "SequenceAdvantageEstimator",
    "UnknownNameError",
    "advantage_estimator_names",
    "apply_kl_penalty",
    "apply_off_policy_correction",
    "compute_advantages",
    "compute_kl",
    "compute_policy_loss",
    "compute_value_loss",
    "get_advantage_estimator",
    "get_policy_loss",
    "is_sequence_level",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "mini_batch_totals",
    "policy_loss_names",
    "reduce_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "sequence_rewards_to_token_level",
    "unregister_advantage_estimator",
    "unregister_policy_loss",
]
