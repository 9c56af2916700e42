"""Custom advantage estimators and policy losses with SkyRL's signatures and registry calls
(`skylift.compat.skyrl.registries`), named by ``trainer.algorithm.import_modules``."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skylift.algorithms import compute_advantages, reduce_loss, unregister_advantage_estimator
from skylift.compat.skyrl.registries import (
    AdvantageEstimatorRegistry,
    PolicyLossRegistry,
    register_advantage_estimator,
    register_policy_loss,
)
from skylift.config import ConfigError, load_config
from skylift.config.algorithm import AlgorithmConfig
from skylift.rl.objective import PolicyObjective
from skylift.rl.update import policy_objective
from skylift.worker.batch import SequenceBatch

ROOT = Path(__file__).resolve().parents[2]
CUSTOM = "tests.skyrl_custom_algorithms"  # SkyRL's two example functions (simple_baseline, reinforce)


@pytest.fixture
def custom_module():  # noqa: ANN201
    cfg = load_config(
        [
            f"trainer.algorithm.import_modules=[{CUSTOM}]",
            "trainer.algorithm.advantage_estimator=simple_baseline",
        ]
    )
    module = sys.modules[CUSTOM]
    module.ESTIMATOR_CALLS.clear()
    return cfg, module


def _batch(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> SequenceBatch:
    rows, length = mask.shape
    return SequenceBatch(
        input_ids=torch.zeros(rows, length + 2, dtype=torch.long),
        attention_mask=torch.ones(rows, length + 2, dtype=torch.long),
        response_mask=mask,
        prompt_len=2,
        extras={"advantages": advantages, "old_logprobs": logprobs.detach()},
    )


def test_a_skyrl_estimator_gets_skyrls_arguments_and_its_result_is_masked(custom_module) -> None:  # noqa: ANN001
    _, module = custom_module
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    advantages, returns = compute_advantages(
        "simple_baseline", rewards, mask, group_ids=["a", "a", "b"], gamma=0.9, lambd=0.8
    )
    want = (rewards - rewards.mean())[:, None] * mask
    torch.testing.assert_close(advantages, want)
    torch.testing.assert_close(returns, want)
    (call,) = module.ESTIMATOR_CALLS
    assert call["index"] == ["a", "a", "b"]  # SkyRL's `index`: the prompt uid of each sequence
    assert call["kwargs"] == ["config", "gamma", "grpo_norm_by_std", "lambd", "values"]


def test_a_scalar_skyrl_loss_counts_on_every_valid_token_and_reduces_to_itself(custom_module) -> None:  # noqa: ANN001
    cfg, _ = custom_module
    cfg = load_config(
        [f"trainer.algorithm.import_modules=[{CUSTOM}]", "trainer.algorithm.policy_loss_type=reinforce"]
    )
    objective = policy_objective(cfg)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    base = torch.randn(2, 4, dtype=torch.float64)
    advantages = torch.tensor([[0.5, 0.5, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    logprobs = base.clone().requires_grad_(True)
    objective = dataclasses.replace(objective, token_count=float(mask.sum()), seq_count=2.0)
    loss, metrics = objective(logprobs, _batch(logprobs, advantages, mask.double()))
    loss.backward()
    direct = base.clone().requires_grad_(True)  # SkyRL's function on the masked tensors, by hand
    expected = (-(direct * mask) * advantages).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logprobs.grad, direct.grad)
    assert metrics["clip_ratio"] == 0.0 and metrics["reinforce_pid"] > 0


def test_per_token_losses_pass_through_and_a_bare_number_is_the_clip_ratio() -> None:
    @register_policy_loss("test_per_token_skyrl")
    def per_token(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):  # noqa: ANN001, ANN202
        assert config.eps_clip_low == 0.2 and rollout_logprobs is None
        return -log_probs * advantages, 0.25

    try:
        mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
        logprobs, adv = torch.randn(2, 2), torch.randn(2, 2)
        loss, metrics = PolicyObjective(
            AlgorithmConfig(policy_loss_type="test_per_token_skyrl"), token_count=3.0
        )(logprobs, _batch(logprobs, adv, mask))
        torch.testing.assert_close(loss, reduce_loss(-logprobs * adv * mask, mask, "token_mean"))
        assert metrics["clip_ratio"] == 0.25
    finally:
        PolicyLossRegistry.unregister("test_per_token_skyrl")


def test_a_skyrl_loss_reads_the_algorithm_group_under_skyrls_nested_names() -> None:
    """A custom loss written as SkyRL's own losses are (``ppo_utils.compute_policy_loss_sapo``): it
    reads ``config.sapo.tau_pos``, ``config.loss_reduction``, ... of the algorithm group it is handed,
    reduces itself, and trains through skylift's objective like skylift's built-in sapo."""
    seen: dict[str, object] = {}

    @register_policy_loss("test_nested_sapo")
    def nested_sapo(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):  # noqa: ANN001, ANN202
        seen.update(
            dppo=config.dppo.dppo_type,
            tis=config.off_policy_correction.tis_ratio_type,
            cispo=config.cispo.cispo_eps_clip_high,
            clip=(config.eps_clip_low, config.clip_ratio_c),
        )
        ratio = torch.exp(log_probs - old_log_probs)
        tau_pos = torch.as_tensor(config.sapo.tau_pos, dtype=advantages.dtype)
        tau_neg = torch.as_tensor(config.sapo.tau_neg, dtype=advantages.dtype)
        tau = torch.where(advantages > 0, tau_pos, tau_neg)
        loss = -advantages * torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau) * loss_mask
        if config.loss_reduction == "sequence_mean":
            loss = (loss.sum(-1) / loss_mask.sum(-1).clamp(min=1)).mean()
        else:
            loss = loss.sum() / loss_mask.sum()
        return loss, {"clip_ratio": 0.0}

    a = "trainer.algorithm"
    try:
        cfg = load_config(
            [
                f"{a}.policy_loss_type=test_nested_sapo",
                f"{a}.sapo.tau_pos=2.0",
                f"{a}.sapo.tau_neg=0.5",
                f"{a}.loss_reduction=sequence_mean",
                f"{a}.dppo.dppo_type=binary_kl",
                f"{a}.cispo.cispo_eps_clip_high=3.0",
            ]
        )
        mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
        base = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -0.7]], dtype=torch.float64)
        advantages = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
        old = base + torch.tensor([[0.3, -0.2, 0.0], [0.1, -0.4, 0.25]], dtype=torch.float64)
        batch = _batch(base, advantages, mask).with_extras(old_logprobs=old)
        objective = dataclasses.replace(policy_objective(cfg), token_count=5.0, seq_count=2.0)
        builtin = dataclasses.replace(
            objective, algorithm=dataclasses.replace(cfg.trainer.algorithm, policy_loss_type="sapo")
        )
        custom_logp, builtin_logp = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
        got, _ = objective(custom_logp, batch)
        want, _ = builtin(builtin_logp, batch)
        (got + want).backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(custom_logp.grad, builtin_logp.grad)
        assert custom_logp.grad.abs().sum() > 0
        assert seen == {"dppo": "binary_kl", "tis": None, "cispo": 3.0, "clip": (0.2, 3.0)}
        # the group travels to the workers as it is (pickled), nested names and all
        assert pickle.loads(pickle.dumps(objective)).algorithm.sapo.tau_neg == 0.5
    finally:
        PolicyLossRegistry.unregister("test_nested_sapo")


def test_wrong_returns_name_the_function_and_the_shapes() -> None:
    @register_advantage_estimator("test_bad_shape")
    def bad_shape(token_level_rewards, response_mask, index, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return token_level_rewards[:, :1], token_level_rewards

    AdvantageEstimatorRegistry.register("test_not_a_pair", lambda **kwargs: torch.zeros(2, 3))
    PolicyLossRegistry.register("test_bad_loss", lambda *args, **kwargs: (torch.zeros(3), {}))
    try:
        mask = torch.ones(2, 3)
        with pytest.raises(
            ValueError, match=r"'bad_shape' returned advantages of shape \(2, 1\); expected \(2, 3\)"
        ):
            compute_advantages("test_bad_shape", torch.ones(2), mask)
        with pytest.raises(TypeError, match="must return \\(advantages, returns\\)"):
            compute_advantages("test_not_a_pair", torch.ones(2), mask)
        with pytest.raises(ValueError, match=r"loss of shape \(3,\); expected one number or \(2, 3\)"):
            PolicyObjective(AlgorithmConfig(policy_loss_type="test_bad_loss"))(
                torch.zeros(2, 3), _batch(torch.zeros(2, 3), mask, mask)
            )
        with pytest.raises(ValueError, match="already registered"):
            AdvantageEstimatorRegistry.register("grpo", bad_shape)
    finally:
        unregister_advantage_estimator("test_bad_shape")
        AdvantageEstimatorRegistry.unregister("test_not_a_pair")
        PolicyLossRegistry.unregister("test_bad_loss")
    assert "test_bad_shape" not in AdvantageEstimatorRegistry.list_available()


def test_config_names_the_key_for_a_custom_name_and_checks_it_after_the_import() -> None:
    a = "trainer.algorithm"
    with pytest.raises(
        ConfigError,
        match=f"'simple_baselin' is not one of grpo, .*list the module that registers it in {a}.import_modules",
    ):
        load_config([f"{a}.advantage_estimator=simple_baselin"])
    with pytest.raises(ConfigError, match=f"{a}.import_modules registered .*reinforce"):
        load_config([f"{a}.import_modules=[{CUSTOM}]", f"{a}.policy_loss_type=reinforc"])
    with pytest.raises(ConfigError, match=f"{a}.import_modules: cannot import 'no_such_module_xyz'"):
        load_config([f"{a}.import_modules=[no_such_module_xyz]", f"{a}.policy_loss_type=reinforce"])
    cfg = load_config(
        [
            f"{a}.import_modules=[{CUSTOM}]",
            f"{a}.policy_loss_type=reinforce",
            f"{a}.advantage_estimator=simple_baseline",
        ]
    )
    assert (cfg.trainer.algorithm.policy_loss_type, cfg.trainer.algorithm.advantage_estimator) == (
        "reinforce",
        "simple_baseline",
    )


def test_a_worker_process_imports_the_module_the_objective_names(tmp_path: Path) -> None:
    """A training worker is another process started elsewhere: the pickled objective brings the
    module names and the driver's directory, and the loss is found there."""
    (tmp_path / "my_losses.py").write_text(
        "import torch\n"
        "from skylift.compat.skyrl.registries import PolicyLossRegistry\n"
        "PolicyLossRegistry.register('mine', lambda lp, old, adv, config, loss_mask=None, rollout_logprobs=None: "
        "((-lp * adv).sum(), {'clip_ratio': 0.5}))\n"
    )
    objective = PolicyObjective(
        AlgorithmConfig(policy_loss_type="mine", import_modules=["my_losses"]),
        search_dir=str(tmp_path),
        token_count=2.0,
    )
    script = (
        "import pickle, sys, torch\n"
        "from skylift.worker.batch import SequenceBatch\n"
        "objective = pickle.loads(sys.stdin.buffer.read())\n"
        "mask = torch.ones(1, 2)\n"
        "batch = SequenceBatch(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.long),"
        " response_mask=mask, prompt_len=2, extras={'advantages': torch.ones(1, 2)})\n"
        "loss, metrics = objective(torch.full((1, 2), -0.5), batch)\n"
        "print(round(float(loss), 6), metrics['clip_ratio'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=pickle.dumps(objective),
        capture_output=True,
        cwd=ROOT / "skylift",
        check=False,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    # the scalar 1.0 counts on each of the 2 tokens; token_mean over the 2 tokens gives it back
    assert out.stdout.decode().split() == ["1.0", "0.5"]


def test_the_configs_built_in_names_are_the_registered_ones() -> None:
    from skylift.algorithms import advantage_estimator_names, policy_loss_names
    from skylift.config.algorithm import ADVANTAGE_ESTIMATORS, POLICY_LOSS_TYPES

    assert set(ADVANTAGE_ESTIMATORS) <= set(advantage_estimator_names())
    assert set(POLICY_LOSS_TYPES) <= set(policy_loss_names())
    registered_here = {"simple_baseline", "reinforce"}  # by tests.skyrl_custom_algorithms, if imported
    assert set(advantage_estimator_names()) - registered_here == set(ADVANTAGE_ESTIMATORS)
    assert set(policy_loss_names()) - registered_here == set(POLICY_LOSS_TYPES)


def test_on_policy_distillation_needs_the_kl_in_reward_step_and_a_fixed_coefficient() -> None:
    a = "trainer.algorithm"
    with pytest.raises(ConfigError, match="on_policy_distillation=true replaces the KL-in-reward step"):
        load_config([f"{a}.on_policy_distillation=true"])
    with pytest.raises(ConfigError, match="kl_ctrl.type=adaptive has nothing to control"):
        load_config(
            [f"{a}.on_policy_distillation=true", f"{a}.use_kl_in_reward=true", f"{a}.kl_ctrl.type=adaptive"]
        )
    cfg = load_config(
        [
            f"{a}.on_policy_distillation=true",
            f"{a}.use_kl_in_reward=true",
            f"{a}.advantage_estimator=no_op",
            f"{a}.policy_loss_type=importance_sampling",
        ]
    )
    from skylift.rl.experience import ExperienceStages

    stages = ExperienceStages.from_config(cfg, pad_token_id=0)
    assert stages.kl.distillation and stages.kl.enabled and stages.staleness.old_logprobs == "trainer"


def test_importance_sampling_and_cross_entropy_losses() -> None:
    from skylift.algorithms import compute_policy_loss

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    logp, old, adv = (
        torch.tensor([[-1.0, -0.5, -9.0]]),
        torch.tensor([[-1.2, -0.5, 0.0]]),
        torch.tensor([[2.0, -1.0, 5.0]]),
    )
    loss, metrics = compute_policy_loss("importance_sampling", logp, old, adv, mask, AlgorithmConfig())
    torch.testing.assert_close(loss, torch.tensor([[-2.0 * torch.exp(torch.tensor(0.2)).item(), 1.0, 0.0]]))
    assert metrics["ratio_max"] == pytest.approx(torch.exp(torch.tensor(0.2)).item())
    loss, _ = compute_policy_loss("cross_entropy", logp, old, adv, mask, AlgorithmConfig())
    torch.testing.assert_close(loss, torch.tensor([[1.0, 0.5, 0.0]]))
