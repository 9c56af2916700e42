"""The ``trainer.algorithm`` group of the schema: advantages, policy loss, KL and dynamic sampling."""

from __future__ import annotations

from dataclasses import dataclass

from skylift.config.fields import _f, _group

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "maxrl", "reinforce++", "gae", "no_op")
POLICY_LOSS_TYPES = (
    "regular",
    "dual_clip",
    "gspo",
    "cispo",
    "sapo",
    "clip_cov",
    "kl_cov",
    "rollout_is",
    "dppo",
    "importance_sampling",
    "cross_entropy",
)
DPPO_TYPES = ("binary_tv", "binary_kl")
TIS_RATIO_TYPES = ("token", "sequence")
SEQUENCE_MASK_METRICS = ("geometric", "product")
LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")
KL_ESTIMATOR_TYPES = ("k1", "k2", "k3")
KL_CTRL_TYPES = ("fixed", "adaptive")
DYNAMIC_SAMPLING_TYPES = ("filter", "replace")


@dataclass
class KLCtrlConfig:
    """KL coefficient controller for use_kl_in_reward."""

    type: str = _f(
        "fixed",
        f"controller: {' | '.join(KL_CTRL_TYPES)} (initial coefficient = kl_loss_coef); adaptive moves it "
        "after every step by (1 + clip(kl / kl_target - 1, -0.2, 0.2) * sequences / horizon)",
        choices=KL_CTRL_TYPES,
    )
    kl_target: float = _f(0.1, "target KL per token (mean over sequences) of the adaptive controller", gt=0)
    horizon: int = _f(10000, "adaptive: sequences over which the coefficient may change by 20%", ge=1)


@dataclass
class CISPOConfig:
    """Clipping of the importance weights in the cispo policy loss."""

    cispo_eps_clip_low: float = _f(
        0.0, "lower clip: weights below 1 - this are clipped (not eps_clip_low)", ge=0
    )
    cispo_eps_clip_high: float = _f(
        5.0, "upper clip: weights above 1 + this are clipped (not eps_clip_high)", ge=0
    )


@dataclass
class SAPOConfig:
    """SAPO's soft gate ``(4 / tau) * sigmoid(tau * (r - 1))`` (policy_loss_type=sapo)."""

    tau_pos: float = _f(1.0, "sapo: gate temperature of tokens with a positive advantage", gt=0)
    tau_neg: float = _f(1.05, "sapo: gate temperature of tokens with a zero or negative advantage", gt=0)


@dataclass
class ClipCovConfig:
    """Clip-Cov (policy_loss_type=clip_cov): PPO clip, and a few mid-covariance tokens dropped."""

    clip_ratio: float = _f(
        0.0002,
        "clip_cov: share of a micro-batch's valid tokens (at least 1) whose loss is dropped, drawn at "
        "random among the unclipped tokens whose advantage-logprob covariance is in (clip_cov_lb, clip_cov_ub)",
        ge=0,
        le=1,
    )
    clip_cov_lb: float = _f(1.0, "clip_cov: lower bound (exclusive) of the covariance of dropped tokens")
    clip_cov_ub: float = _f(5.0, "clip_cov: upper bound (exclusive) of the covariance of dropped tokens")


@dataclass
class KLCovConfig:
    """KL-Cov (policy_loss_type=kl_cov): unclipped surrogate, |log r| penalty on high-covariance tokens."""

    kl_cov_frac: float = _f(
        0.2,
        "kl_cov: share of a micro-batch's valid tokens (at least 1) of largest advantage-logprob "
        "covariance that get the penalty",
        ge=0,
        le=1,
    )
    ppo_kl_coef: float = _f(1.0, "kl_cov: weight of the |log(pi / pi_old)| penalty", ge=0)


@dataclass
class DPPOConfig:
    """DPPO (policy_loss_type=dppo): ``-A r`` against the rollout policy, tokens whose probability
    moved too far in the advantage's direction dropped (skylift.algorithms.divergence_losses)."""

    dppo_type: str = _f(
        "binary_tv",
        "dppo: binary_tv drops a token whose probability moved past the bound in its advantage's "
        "direction | binary_kl: one whose Bernoulli KL to the rollout policy's exceeds the bound",
        choices=DPPO_TYPES,
    )
    delta_low: float = _f(
        0.2, "dppo: bound for tokens with a negative advantage (0.05 suits binary_kl)", ge=0
    )
    delta_high: float = _f(
        0.2, "dppo: bound for tokens with a positive advantage (0.05 suits binary_kl)", ge=0
    )


@dataclass
class OffPolicyCorrectionConfig:
    """Corrections of the gap between the trainer's logprobs and the rollout engine's
    (ratio ``w = pi_old / pi_rollout`` per token; skylift.algorithms.off_policy)."""

    tis_ratio_type: str | None = _f(
        None,
        "truncated importance sampling: null = off | token: each token's loss times "
        "min(w, token_tis_ratio_clip_high) | sequence: each sequence's loss times min(prod w, "
        "sequence_tis_ratio_clip_high) (exclusive with use_tis)",
        choices=TIS_RATIO_TYPES,
    )
    token_tis_ratio_clip_high: float = _f(2.0, "tis_ratio_type=token: cap of the token weight", gt=0)
    sequence_tis_ratio_clip_high: float = _f(5.0, "tis_ratio_type=sequence: cap of the sequence weight", gt=0)
    sequence_mask_metric: str | None = _f(
        None,
        "null = off | geometric: drop sequences whose geometric mean of w is outside [geo_mask_low, "
        "geo_mask_high] | product: whose product of w is outside [product_mask_low, product_mask_high]",
        choices=SEQUENCE_MASK_METRICS,
    )
    geo_mask_high: float = _f(1.01, "sequence_mask_metric=geometric: upper bound", gt=0)
    geo_mask_low: float = _f(0.99, "sequence_mask_metric=geometric: lower bound", ge=0)
    product_mask_high: float = _f(2.0, "sequence_mask_metric=product: upper bound", gt=0)
    product_mask_low: float = _f(0.5, "sequence_mask_metric=product: lower bound", ge=0)
    outlier_token_is_threshold_low: float | None = _f(
        None, "drop a whole sequence with any token's w below this (null = no bound)", ge=0
    )
    outlier_token_is_threshold_high: float | None = _f(
        None, "drop a whole sequence with any token's w above this (null = no bound)", gt=0
    )
    token_mask_is_threshold_low: float | None = _f(
        None, "with token_mask_is_threshold_high: drop tokens whose w is below this", ge=0
    )
    token_mask_is_threshold_high: float | None = _f(
        None, "with token_mask_is_threshold_low: drop tokens whose w is above this", gt=0
    )

    @property
    def enabled(self) -> bool:
        """Whether any correction is on (it needs the trainer's logprobs before the update)."""
        return (
            self.tis_ratio_type is not None
            or self.sequence_mask_metric is not None
            or self.outlier_token_is_threshold_low is not None
            or self.outlier_token_is_threshold_high is not None
            or self.token_mask_is_threshold_low is not None
        )


@dataclass
class DynamicSamplingConfig:
    """DAPO-style dynamic sampling: train on prompt groups whose rewards differ."""

    type: str | None = _f(
        None,
        f"null = off | {' | '.join(DYNAMIC_SAMPLING_TYPES)}: filter samples more prompt groups until the "
        "batch holds train_batch_size groups with mixed rewards; replace swaps groups without a signal "
        "for copies of groups with one",
        choices=DYNAMIC_SAMPLING_TYPES,
    )
    max_sample_batches: int = _f(
        30,
        "most rounds of prompts sampled for one step (the first included); -1 = until the data runs out",
        or_minus_one="for no limit",
    )
    gen_batch_size: int = _f(
        -1,
        "prompts generated per sampling round; a value above train_batch_size oversamples: the first "
        "round generates the batch's prompts and gen_batch_size - train_batch_size more of the data in "
        "one call, which costs less than a second round (verl's data.gen_batch_size)",
        or_minus_one="for train_batch_size",
    )
    min_replace_ratio: float = _f(
        0.3,
        "replace: sample more rounds while fewer than this fraction of the batch's groups has a signal",
        ge=0,
        le=1,
    )


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (``overlong_buffer.len`` or, the flat spelling,
    ``overlong_buffer_len``)."""

    len: int = _f(
        0,
        "0 = off; else a response of L tokens longer than max_generate_length - len loses "
        "(L - (max_generate_length - len)) / len * penalty_factor of its reward (over "
        "max_generate_length: reward 0)",
        ge=0,
    )
    penalty_factor: float = _f(1.0, "reward lost by a response of exactly max_generate_length tokens", ge=0)


@dataclass
class AlgorithmConfig:
    """Advantages, policy loss and KL."""

    advantage_estimator: str = _f(
        "grpo",
        f"advantage estimator: {' | '.join(ADVANTAGE_ESTIMATORS)}, or one a module in import_modules registers",
    )
    grpo_norm_by_std: bool = _f(True, "grpo: divide group-centred rewards by the group's std")
    zero_variance_filter: bool = _f(
        False,
        "loss-mask the prompt groups whose rewards are all equal (more than one trajectory with a "
        "loss token, rewards within zero_variance_filter_tol); response-level rewards only",
    )
    zero_variance_filter_tol: float = _f(
        1e-6, "zero_variance_filter: rewards this close count as equal (0 = exact equality)", ge=0
    )
    advantage_batch_normalize: bool = _f(False, "normalise advantages over the whole training batch")
    policy_loss_type: str = _f(
        "regular",
        f"policy loss: {' | '.join(POLICY_LOSS_TYPES)} (regular = PPO clip), or one a module in "
        "import_modules registers",
    )
    import_modules: list[str] = _f(
        [],
        "modules imported before the run (and in every training worker) for their "
        "register_advantage_estimator / register_policy_loss calls (skylift's signatures or the "
        "seed's); looked up on sys.path, then in the current directory",
    )
    loss_reduction: str = _f(
        "token_mean", f"how token losses are averaged: {' | '.join(LOSS_REDUCTIONS)}", choices=LOSS_REDUCTIONS
    )
    eps_clip_low: float = _f(0.2, "PPO clip (not cispo): ratio lower bound is 1 - eps_clip_low", ge=0)
    eps_clip_high: float = _f(0.2, "PPO clip (not cispo): ratio upper bound is 1 + eps_clip_high", ge=0)
    clip_ratio_c: float = _f(3.0, "dual_clip: bound c (> 1) on the loss for negative advantages")
    cispo: CISPOConfig = _group(CISPOConfig, "cispo settings")
    sapo: SAPOConfig = _group(SAPOConfig, "sapo settings")
    clip_cov: ClipCovConfig = _group(ClipCovConfig, "clip_cov settings")
    kl_cov: KLCovConfig = _group(KLCovConfig, "kl_cov settings")
    dppo: DPPOConfig = _group(DPPOConfig, "dppo settings")
    use_kl_loss: bool = _f(False, "add kl_loss_coef * KL(policy || ref) to the policy loss")
    kl_loss_coef: float = _f(0.001, "weight of the KL term (loss or reward)", ge=0)
    kl_estimator_type: str = _f(
        "k3",
        f"KL estimator: {' | '.join(KL_ESTIMATOR_TYPES)} (see joschu.net/blog/kl-approx)",
        choices=KL_ESTIMATOR_TYPES,
    )
    use_kl_in_reward: bool = _f(
        False, "subtract the KL penalty from rewards instead (exclusive with use_kl_loss)"
    )
    kl_ctrl: KLCtrlConfig = _group(KLCtrlConfig, "KL controller for use_kl_in_reward")
    on_policy_distillation: bool = _f(
        False,
        "on-policy distillation: "
        "the KL-in-reward step (needs use_kl_in_reward=true) makes each response token's reward "
        "-(log pi(token) - log pi_ref(token)), the reference model being the teacher; the "
        "environment's reward is only logged. Usually with advantage_estimator=no_op and "
        "policy_loss_type=importance_sampling",
    )
    gamma: float = _f(1.0, "gae / reinforce++: discount factor", ge=0, le=1)
    lambd: float = _f(1.0, "gae: lambda of generalised advantage estimation", ge=0, le=1)
    value_clip: float = _f(0.2, "critic: value clip range", ge=0)
    enable_sample_support_replay: bool | None = _f(
        None,
        "score rollout tokens under the distribution the engine sampled from: the sampling temperature "
        "then generator.sampling_params' min_p, top_k and top_p with vLLM's rules, renormalised over "
        "the tokens left (no mass and no gradient outside them); null = on whenever sampling truncates. "
        "The KL to the reference stays on the untruncated distribution",
    )
    use_tis: bool = _f(False, "truncated importance sampling: reweight by min(pi_train / pi_rollout, cap)")
    tis_imp_ratio_cap: float = _f(-1.0, "truncated importance sampling: cap of the ratio (> 0 when use_tis)")
    off_policy_correction: OffPolicyCorrectionConfig = _group(
        OffPolicyCorrectionConfig, "off-policy corrections: TIS per token or sequence, masks"
    )
    dynamic_sampling: DynamicSamplingConfig = _group(DynamicSamplingConfig, "dynamic sampling (DAPO)")
    overlong_buffer: OverlongBufferConfig = _group(OverlongBufferConfig, "soft overlong punishment (DAPO)")
    max_seq_len: int | None = _f(
        None,
        "seq_mean_token_sum_norm (Dr. GRPO): the constant L each sequence's token sum is divided by; "
        "null = the longest response (generator max_generate_length)",
        ge=1,
    )

    @property
    def corrects_off_policy(self) -> bool:
        """Whether the loss corrects the gap between the trainer's logprobs before the update and
        the rollout logprobs: TIS (either spelling) or an off-policy mask."""
        return self.use_tis or self.off_policy_correction.enabled
