"""Config keys that changed from accepted-and-ignored to live, checked for their effect on a real
server (one tiny-model server for the whole file): min_p and repetition_penalty in sampling,
generator.batched / use_conversation_multi_turn / environment.max_env_workers in rollouts, the
adaptive KL controller and weight_sync_backend=delta in training runs."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from skylift.config import load_config
from skylift.data import PromptDataset, write_arithmetic_dataset
from skylift.envs import Environment, StepResult, register_env
from skylift.envs.arithmetic import RETRY_FEEDBACK
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.generator import rollout_seed
from skylift.inference.remote import RemoteInferenceEngine
from skylift.inference.types import SamplingParams
from skylift.rl import checkpoint as ckpt
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration

ENV_THREADS: set[str] = set()


@register_env("test_thread_recorder", override=True)
class ThreadRecorderEnv(Environment):
    """Reward 1 for an even-length response; records the thread its step ran in."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        ENV_THREADS.add(threading.current_thread().name)
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith_live")
    write_arithmetic_dataset(out, num_train=16, num_val=4, seed=3)
    return out


@pytest.fixture(scope="module")
def rows(data: Path) -> list:
    return list(PromptDataset(data / "train.parquet"))[:3]


def _generate(engine: RemoteInferenceEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return asyncio.run(engine.generate([prompt], params))[0].completions[0].token_ids


def test_min_p_one_keeps_only_the_most_likely_token(tiny_server_url: str) -> None:
    engine = RemoteInferenceEngine(tiny_server_url)
    prompt = [11, 12, 13, 14, 15, 16]
    greedy = _generate(engine, prompt, SamplingParams(temperature=0.0, max_tokens=16, logprobs=False))
    hot = [
        _generate(engine, prompt, SamplingParams(temperature=1.5, max_tokens=16, seed=s, logprobs=False))
        for s in range(3)
    ]
    assert any(h != greedy for h in hot)  # hot sampling wanders off the greedy path...
    for s in range(3):  # ...unless min_p=1 drops every token below the most likely one
        params = SamplingParams(temperature=1.5, min_p=1.0, max_tokens=16, seed=s, logprobs=False)
        assert _generate(engine, prompt, params) == greedy


def _repeats(prompt: list[int], response: list[int]) -> int:
    """Response tokens already seen in the prompt or earlier in the response."""
    seen, count = set(prompt), 0
    for token in response:
        count += token in seen
        seen.add(token)
    return count


def test_repetition_penalty_discourages_repeated_tokens(tiny_server_url: str) -> None:
    engine = RemoteInferenceEngine(tiny_server_url)
    prompt = [11, 12, 13, 14, 15, 16]
    plain = _generate(engine, prompt, SamplingParams(temperature=0.0, max_tokens=24, logprobs=False))
    assert _repeats(prompt, plain) > 0, "greedy text of the tiny model repeats tokens"
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=50.0, logprobs=False)
    penalised = _generate(engine, prompt, params)
    assert _repeats(prompt, penalised) < _repeats(prompt, plain)


def test_unbatched_rollouts_and_env_threads_give_the_batched_trajectories(
    rows: list, tiny_model_dir: Path, tiny_server_url: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RemoteInferenceEngine(tiny_server_url)
    recorded = [dataclasses.replace(r, env_class="test_thread_recorder") for r in rows]
    params = SamplingParams(temperature=1.0, max_tokens=12)
    seeds = [rollout_seed(7, 1, r.uid) for r in rows]

    def run(**settings: object) -> list[tuple[list[int], float]]:
        ENV_THREADS.clear()
        gen = Generator(engine, tokenizer, GeneratorSettings(max_generate_length=12, **settings))  # type: ignore[arg-type]
        trajectories = asyncio.run(gen.generate(recorded, n=2, params=params, seeds=seeds))
        return [(t.response_ids, t.reward) for t in trajectories]

    batched = run()
    assert ENV_THREADS == {threading.main_thread().name}  # inline: max_env_workers=0
    # one request per trajectory (the agent loop) samples the same tokens: sample j of a row has
    # seed + j either way
    assert run(batched=False) == batched
    assert run(env_workers=2) == batched
    assert ENV_THREADS and all(name.startswith("env") for name in ENV_THREADS)  # in the env threads


def test_observations_as_plain_text_continue_the_assistant_turn(
    rows: list, tiny_model_dir: Path, tiny_server_url: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RemoteInferenceEngine(tiny_server_url)
    multi = [dataclasses.replace(r, env_class="arithmetic_multiturn") for r in rows]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    feedback = tokenizer.encode(RETRY_FEEDBACK, add_special_tokens=False)

    def masked_runs(conversation: bool) -> list[list[int]]:
        settings = GeneratorSettings(
            max_generate_length=8,
            max_turns=2,
            env_kwargs={"max_turns": 2},
            conversation_multi_turn=conversation,
        )
        trajectories = asyncio.run(Generator(engine, tokenizer, settings).generate(multi, n=1, params=params))
        runs = []
        for t in trajectories:
            assert t.num_turns == 2  # the tiny model never answers right: feedback, then a second turn
            runs.append([tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 0])
        return runs

    assert all(run == feedback for run in masked_runs(conversation=False))  # the text alone
    chat = masked_runs(conversation=True)  # a user message and the next assistant header around it
    assert all(len(run) > len(feedback) for run in chat)


def _run_overrides(
    data: Path, model: Path, server_url: str, tmp_path: Path, keys: dict[str, object]
) -> list[str]:
    """A short training run against the shared server, every row scored by `test_thread_recorder`,
    without evaluation or checkpoints unless `keys` (set on top) ask for them."""
    base: dict[str, object] = {
        "trainer.policy.model.path": str(model),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": "[]",
        "environment.env_class": "test_thread_recorder",
        "data.env_class_key": "no_such_column",  # every row falls back to environment.env_class
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{server_url.removeprefix('http://')}']",
        "generator.override_existing_update_group": True,
        "trainer.max_prompt_length": 128,
        "trainer.eval_before_train": False,
        "trainer.eval_interval": -1,
        "trainer.ckpt_interval": -1,
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
    }
    return [f"{k}={v}" for k, v in {**base, **keys}.items()]


def test_adaptive_kl_controller_moves_the_reward_penalty(
    data: Path, tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    target, horizon, coef = 0.01, 32, 0.1
    overrides = _run_overrides(
        data,
        tiny_model_dir,
        tiny_server_url,
        tmp_path,
        {
            "trainer.train_batch_size": 4,
            "trainer.policy_mini_batch_size": 4,
            "generator.n_samples_per_prompt": 4,
            "generator.max_generate_length": 12,
            "trainer.max_steps": 3,
            "trainer.ckpt_interval": 3,
            "trainer.policy.optimizer_config.lr": 1e-2,
            "trainer.algorithm.use_kl_in_reward": True,
            "trainer.algorithm.kl_loss_coef": coef,
            "trainer.algorithm.kl_ctrl.type": "adaptive",
            "trainer.algorithm.kl_ctrl.kl_target": target,
            "trainer.algorithm.kl_ctrl.horizon": horizon,
            "trainer.ckpt_path": str(tmp_path / "ckpts"),
        },
    )
    trainer = build_trainer(load_config(overrides), console=False)
    try:
        trainer.setup()
        history = [h for h in trainer.fit() if "kl_in_reward/kl_coef" in h]
    finally:
        trainer.shutdown()
    assert [h["step"] for h in history] == [1, 2, 3]
    expected = coef
    for row in history:  # each step's penalty uses the coefficient the previous steps left
        assert row["kl_in_reward/kl_coef"] == pytest.approx(expected)
        error = min(max(row["kl_in_reward/kl_seq_mean"] / target - 1.0, -0.2), 0.2)
        expected *= 1.0 + error * 16 / horizon  # 16 sequences per step
    assert history[0]["kl_in_reward/kl_seq_mean"] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert history[0]["kl_in_reward/kl_coef"] != history[1]["kl_in_reward/kl_coef"]
    saved = ckpt.load_trainer_state(tmp_path / "ckpts" / "global_step_3")
    assert saved.extra["kl_coef"] == pytest.approx(expected)  # a resumed run continues from here


def test_delta_weight_sync_leaves_the_server_on_the_trained_weights(
    data: Path, tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    """weight_sync_backend=delta in a training run against the shared server: the policy's rank 0
    publishes under sync_dir, the server applies and loads through /skylift/delta/*; after the run
    it scores like the trained policy exported to disk."""
    import torch
    from transformers import AutoModelForCausalLM

    from skylift.weight_sync.delta.apply import DeltaStore
    from skylift.weight_sync.delta.format import read_manifest

    ie = "generator.inference_engine."
    overrides = _run_overrides(
        data,
        tiny_model_dir,
        tiny_server_url,
        tmp_path,
        {
            f"{ie}weight_sync_backend": "delta",
            f"{ie}delta_weight_sync.sync_dir": str(tmp_path / "sync"),
            f"{ie}delta_weight_sync.local_checkpoint_dir": str(tmp_path / "store"),
            f"{ie}delta_weight_sync.rebase_interval": 3,  # version 3 against the base, 1 and 2 deleted
            "trainer.train_batch_size": 2,
            "trainer.policy_mini_batch_size": 2,
            "generator.n_samples_per_prompt": 2,
            "generator.max_generate_length": 8,
            "trainer.max_steps": 2,
            "trainer.policy.optimizer_config.lr": 1e-2,
        },
    )
    trainer = build_trainer(load_config(overrides), console=False)
    try:
        trainer.setup()
        trainer.fit()
        exported = trainer.parts.policy.export_hf(str(tmp_path / "trained"))
    finally:
        trainer.shutdown()
    state = DeltaStore(tmp_path / "store", tiny_model_dir).state()
    assert state.version == 3 and read_manifest(tmp_path / "sync", 3).tensors  # trained: changed
    assert [p.name for p in (tmp_path / "sync" / "deltas").iterdir()] == ["delta-00000003"]
    sequences = [[5, 17, 230, 999, 42, 8, 77, 301], [900, 3, 3, 64, 512, 1000, 12]]
    served = asyncio.run(RemoteInferenceEngine(tiny_server_url).prompt_logprobs(sequences))
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    for tokens, got in zip(sequences, served, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
        want = [logp[i - 1, t].item() for i, t in enumerate(tokens) if i > 0]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4


def test_skyrl_style_custom_estimator_and_loss_run_on_the_driver_and_in_the_workers(
    data: Path, tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    """SkyRL's custom_advantage_estimator / custom_policy_loss examples: their functions (SkyRL's
    signatures, `tests/skyrl_custom_algorithms.py`) named by trainer.algorithm.import_modules train
    two steps; the estimator runs in this process, the loss in the training workers' processes."""
    import importlib

    from server_helpers import require_loopback_namespace

    require_loopback_namespace()
    import os

    overrides = _run_overrides(
        data,
        tiny_model_dir,
        tiny_server_url,
        tmp_path,
        {
            "trainer.placement.backend": "ray",  # the workers are Ray actors: other processes
            "trainer.algorithm.import_modules": "[tests.skyrl_custom_algorithms]",
            "trainer.algorithm.advantage_estimator": "simple_baseline",
            "trainer.algorithm.policy_loss_type": "reinforce",
            "trainer.train_batch_size": 2,
            "trainer.policy_mini_batch_size": 2,
            "generator.n_samples_per_prompt": 2,
            "generator.max_generate_length": 8,
            "trainer.max_steps": 2,
        },
    )
    cfg = load_config(overrides)
    custom = importlib.import_module("tests.skyrl_custom_algorithms")
    custom.ESTIMATOR_CALLS.clear()
    trainer = build_trainer(cfg, console=False)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    steps = [h for h in history if "policy/reinforce_pid" in h]
    assert [h["step"] for h in steps] == [1, 2]
    assert all(h["policy/reinforce_pid"] != os.getpid() for h in steps)  # the loss ran in a worker
    assert [call["pid"] for call in custom.ESTIMATOR_CALLS] == [os.getpid()] * 2  # once per step, here
    assert all(len(call["index"]) == 4 for call in custom.ESTIMATOR_CALLS)  # 2 prompts x 2 samples


def _reverse_kl(student_dir: Path, teacher_dir: Path, sequences: list[tuple[list[int], int]]) -> float:
    """Mean of KL(student || teacher) over the whole vocabulary at the response positions of
    (tokens, prompt length) pairs."""
    import torch
    from transformers import AutoModelForCausalLM

    models = [
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for d in (student_dir, teacher_dir)
    ]
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, start in sequences:
            student, teacher = (
                torch.log_softmax(m(torch.tensor([tokens])).logits[0, start - 1 : -1], -1) for m in models
            )
            total += float((student.exp() * (student - teacher)).sum())
            count += len(tokens) - start
    return total / count


def test_on_policy_distillation_moves_the_policy_towards_the_teacher(
    data: Path, rows: list, tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    """SkyRL's on_policy_distillation command (no_op, importance_sampling, use_kl_in_reward) with
    trainer.algorithm.on_policy_distillation=true: the reference model is a teacher (the tiny model
    with its weights perturbed), each token's reward -(logp - teacher logp); the policy's reverse
    KL to the teacher on its responses falls."""
    import torch
    from transformers import AutoModelForCausalLM

    teacher_dir = tmp_path / "teacher"
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in teacher.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    teacher.save_pretrained(teacher_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(teacher_dir)
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    sequences = []  # the initial policy's greedy responses to the training prompts
    for row in rows:
        prompt = list(
            tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, return_dict=False)
        )
        out = student.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
        sequences.append((out[0].tolist(), len(prompt)))
    before = _reverse_kl(tiny_model_dir, teacher_dir, sequences)

    a = "trainer.algorithm."
    overrides = _run_overrides(
        data,
        tiny_model_dir,
        tiny_server_url,
        tmp_path,
        {
            "trainer.ref.model.path": str(teacher_dir),
            f"{a}on_policy_distillation": True,
            f"{a}advantage_estimator": "no_op",
            f"{a}policy_loss_type": "importance_sampling",
            f"{a}use_kl_in_reward": True,
            f"{a}use_kl_loss": False,
            "trainer.train_batch_size": 8,
            "trainer.policy_mini_batch_size": 8,
            "generator.n_samples_per_prompt": 4,
            "generator.max_generate_length": 16,
            "trainer.max_steps": 8,
            "trainer.epochs": 4,
            "trainer.policy.optimizer_config.lr": 1e-3,
        },
    )
    trainer = build_trainer(load_config(overrides), console=False)
    try:
        trainer.setup()
        history = [h for h in trainer.fit() if "kl_in_reward/kl" in h]
        exported = trainer.parts.policy.export_hf(str(tmp_path / "trained"))
    finally:
        trainer.shutdown()
    after = _reverse_kl(Path(exported), teacher_dir, sequences)
    print(
        f"reverse KL to the teacher on the initial responses: {before:.4f} -> {after:.4f}; sampled per step:",
        [round(h["kl_in_reward/kl"], 4) for h in history],
    )
    assert len(history) == 8 and all(h["kl_in_reward/kl_coef"] == 1.0 for h in history)
    assert before > 0.01  # the teacher differs
    # trained on the environment reward instead (on_policy_distillation=false), this KL rises
    assert after < 0.8 * before
