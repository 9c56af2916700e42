"""Routing replay end to end on the CPU, the engine a stand-in: `generator.enable_return_routed_experts`.

The engine here is a transformers copy of tiny-qwen3-moe in bfloat16 (an engine's numerics, scripted
replies: every routing known in advance; the real vLLM engine is in
tests/integration/test_moe_training.py) that answers scripted replies with their
logprobs and, as vLLM does, the experts its routers picked for every token but the last. The
generator keeps them aligned with each trajectory's ids (single- and multi-turn), the training batch
carries them per row, and the trainer's forwards (old logprobs, the training step) route every token
the engine routed exactly as the engine did; without replay they route as the trainer's own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from agentic_fakes import Row
from transformers import AutoModelForCausalLM, AutoTokenizer

from skylift.config import ConfigError, load_config
from skylift.envs import Environment, StepResult, register_env
from skylift.generator import Generator, GeneratorSettings
from skylift.inference.codec import output_from_json, output_to_json
from skylift.inference.types import Completion, EngineError, GenerateOutput, SamplingParams
from skylift.models import prepare_model
from skylift.rl.experience import trajectory_batch
from skylift.worker.batch import SequenceBatch
from skylift.worker.routing_replay import moe_routers, routing_of
from skylift.worker.training_worker import TrainingWorker, WorkerSettings

ENV = "test_routing_replay_two_turns"


@register_env(ENV, override=True)
class TwoTurns(Environment):
    """Turn 1 is answered with an observation; turn 2 ends the rollout (single-turn: ends at 1)."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        if self.turns == 1 and self.extras["extra_info"].get("multi", False):
            return StepResult([{"role": "user", "content": "and again?"}], 0.5, False)
        self.done = True
        return StepResult([], 1.0, True)


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    return prepare_model("tiny-qwen3-moe")


class StandInEngine:
    """The generator's engine interface over the policy in bfloat16 (transformers): each request
    is answered with the next scripted reply, its logprobs under this model and, like vLLM with
    ``enable_return_routed_experts``, the routing of prompt + reply but its last token ([tokens,
    layers, top_k], uint8 as vLLM returns it for at most 256 experts)."""

    def __init__(self, model_dir: Path, replies: list[list[int]], routed: bool = True) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        self.replies, self.routed, self.calls = replies, routed, 0

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]:
        outputs = []
        for prompt in prompts:
            completions = []
            for _ in range(params.n):
                reply = self.replies[self.calls % len(self.replies)]
                self.calls += 1
                ids = torch.tensor([list(prompt) + reply])
                with torch.no_grad():
                    logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), -1)
                start = len(prompt)
                logprobs = [float(logp[start - 1 + i, t]) for i, t in enumerate(reply)]
                routed = routing_of(self.model, input_ids=ids[:, :-1]).numpy().astype(np.uint8)
                completions.append(
                    Completion(reply, logprobs, "stop", routed_experts=routed if self.routed else None)
                )
            outputs.append(GenerateOutput(list(prompt), completions))
        return outputs


def _rollouts(moe_dir: Path, multi: bool, routed: bool = True) -> list[Any]:
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    replies = [
        tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        for text in ("yes it is four", "no")
    ]
    engine = StandInEngine(moe_dir, replies, routed)
    settings = GeneratorSettings(default_env_class=ENV, max_turns=2 if multi else 1, routed_experts=routed)
    rows = [
        Row([{"role": "user", "content": q}], ENV, uid=f"row-{i}", extra_info={"multi": multi})
        for i, q in enumerate(("What is two plus two?", "Is it raining?", "Why?", "Say yes."))
    ]
    # distinct prompts: the trainer's forward without replay is the padded one too (rows sharing a
    # prompt share its forward there), so the spy sees every token in one forward
    return asyncio.run(Generator(engine, tokenizer, settings).generate(rows, 1, SamplingParams(max_tokens=8)))


class RoutingSpy:
    """The input ids, attention mask and positions of every forward of `model`, and the experts
    each of its routers picked in it."""

    def __init__(self, model: Any) -> None:
        self.forwards: list[dict[str, Any]] = []
        self.layers = sorted(moe_routers(model))
        self.handles = [model.register_forward_pre_hook(self._inputs, with_kwargs=True)]
        self.handles += [
            router.register_forward_hook(lambda m, a, out, layer=layer: self._picked(layer, out))
            for layer, router in moe_routers(model).items()
        ]

    def _inputs(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.forwards.append({k: kwargs.get(k) for k in ("input_ids", "attention_mask", "position_ids")})
        self.forwards[-1]["picked"] = {}

    def _picked(self, layer: int, out: Any) -> None:
        self.forwards[-1]["picked"][layer] = out[2].detach().clone()

    def rows(self) -> list[tuple[list[int], torch.Tensor, dict[str, Any]]]:
        """(real token ids, their picks [tokens, MoE layers, top_k], the forward) of every row."""
        out = []
        for f in self.forwards:
            ids, mask = f["input_ids"], f["attention_mask"]
            picks = torch.stack([f["picked"][layer] for layer in self.layers], dim=1)
            picks = picks.reshape(*ids.shape, *picks.shape[1:])
            for b in range(ids.shape[0]):
                real = mask[b].bool()
                out.append((ids[b][real].tolist(), picks[b][real], f))
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _trainer_routing(
    moe_dir: Path, tmp_path: Path, batch: SequenceBatch
) -> tuple[RoutingSpy, Any, dict[str, float]]:
    """The routing of the trainer's forwards: old logprobs (no grad) and one training step (whose
    metrics come back too)."""
    worker = TrainingWorker(
        WorkerSettings(model_path=str(moe_dir)), init_method=f"file://{tmp_path / 'rdzv'}"
    )
    worker.setup()
    spy = RoutingSpy(worker.model)
    try:
        worker.compute_logprobs(batch, micro_batch_size=3)
        metrics = worker.accumulate_gradients(
            batch, lambda logp, micro: ((logp * micro.response_mask).sum(), {}), 3
        )
    finally:
        spy.close()
    return spy, worker, metrics


def _differing(spy: RoutingSpy, trajectories: list[Any], layers: list[int]) -> tuple[int, int]:
    """(token, MoE layer) pairs the engine routed whose expert set differs in the trainer's
    forwards, and how many there were."""
    by_ids = {tuple(tr.prompt_ids + tr.response_ids): tr for tr in trajectories}
    differ = total = 0
    for ids, picks, _ in spy.rows():
        engine = torch.as_tensor(by_ids[tuple(ids)].engine_routing).long()[:, layers]
        routed = (engine >= 0).all(-1)
        differ += int((picks[routed].sort(-1).values != engine[routed].sort(-1).values).any(-1).sum())
        total += int(routed.sum())
    return differ, total


@pytest.mark.parametrize("multi", [False, True], ids=["single-turn", "multi-turn"])
def test_trainer_routes_as_the_engine_with_replay_and_as_itself_without(
    moe_dir: Path, tmp_path: Path, multi: bool
) -> None:
    trajectories = _rollouts(moe_dir, multi)
    for tr in trajectories:
        length = len(tr.prompt_ids) + len(tr.response_ids)
        assert tr.routed_experts is not None and tr.routed_experts.shape[0] == length
        routed = (tr.routed_experts >= 0).all(-1).all(-1)
        # every token the engine ran is routed; the last sampled token is not
        assert routed[: length - 1].all() and not routed[-1]
        tr.engine_routing = tr.routed_experts
        assert tr.num_turns == (2 if multi else 1)
    layers = sorted(moe_routers(AutoModelForCausalLM.from_pretrained(moe_dir)))

    with_replay, worker, metrics = _trainer_routing(
        moe_dir, tmp_path / "with", trajectory_batch(trajectories, 0)
    )
    differ, total = _differing(with_replay, trajectories, layers)
    assert total > 0 and differ == 0  # 0 differing (token, layer) routings
    # what replay overrode: the trainer's own routers would have picked otherwise (bf16 engine)
    print(f"routing_differs with replay: {metrics['routing_differs']:.4f} ({differ} of {total} as given)")
    assert 0 < metrics["routing_differs"] < 0.1, metrics

    for tr in trajectories:
        tr.routed_experts = None
    without, worker, metrics = _trainer_routing(
        moe_dir, tmp_path / "without", trajectory_batch(trajectories, 0)
    )
    differ, total = _differing(without, trajectories, layers)
    assert differ > 0, (differ, total)  # bfloat16 engine, float32 trainer: some routers disagree
    assert "routing_differs" not in metrics  # nothing replayed, nothing to say
    model = worker.model
    for ids, picks, forward in without.rows():  # the trainer's own routing, exactly
        inputs = {
            k: forward[k] for k in ("input_ids", "attention_mask", "position_ids") if forward[k] is not None
        }
        own = routing_of(model, **inputs)[:, layers]
        own = own.reshape(*forward["input_ids"].shape, *own.shape[1:])
        b = next(
            b
            for b in range(own.shape[0])
            if forward["input_ids"][b][forward["attention_mask"][b].bool()].tolist() == ids
        )
        assert torch.equal(picks, own[b][forward["attention_mask"][b].bool()])


def test_multi_turn_routing_marks_tokens_the_engine_did_not_route(moe_dir: Path) -> None:
    (tr, *_) = _rollouts(moe_dir, multi=True)
    length = len(tr.prompt_ids) + len(tr.response_ids)
    # the second turn's request held the first turn and the observation: all routed but the last
    assert int((tr.routed_experts < 0).all(-1).all(-1).sum()) == 1
    assert tr.routed_experts.dtype == np.int16 and tr.routed_experts.shape[0] == length


def test_an_engine_without_routing_is_refused_in_one_line(moe_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    engine = StandInEngine(moe_dir, [[5, tokenizer.eos_token_id]], routed=False)
    settings = GeneratorSettings(default_env_class=ENV, routed_experts=True)
    row = Row([{"role": "user", "content": "hi"}], ENV)
    with pytest.raises(
        EngineError, match="enable_return_routed_experts=true but the engine returned no routed"
    ):
        asyncio.run(Generator(engine, tokenizer, settings).generate([row], 1, SamplingParams(max_tokens=4)))


def test_routed_experts_travel_over_http_json() -> None:
    routed = np.arange(2 * 4 * 2, dtype=np.uint8).reshape(2, 4, 2)
    output = GenerateOutput([1, 2], [Completion([3, 4], [-0.1, -0.2], "stop", routed_experts=routed)])
    back = output_from_json(json.loads(json.dumps(output_to_json(output))))
    got = back.completions[0].routed_experts
    assert got.dtype == np.uint8 and np.array_equal(got, routed)
    plain = GenerateOutput([1], [Completion([3], None, "stop")])
    assert (
        output_from_json(json.loads(json.dumps(output_to_json(plain)))).completions[0].routed_experts is None
    )


def test_the_key_is_refused_where_it_cannot_work_in_one_line(moe_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2Config

    from skylift.cluster.routing_run import check_routing_replay

    on = ["generator.enable_return_routed_experts=true", "trainer.policy.model.path=my-model"]
    dense = tmp_path / "dense"
    Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1).save_pretrained(dense)
    with pytest.raises(ConfigError, match="my-model is not a mixture-of-experts model"):
        check_routing_replay(load_config(on), str(dense))
    with pytest.raises(ConfigError, match="needs generator.enable_prefix_caching=true"):
        check_routing_replay(load_config([*on, "generator.enable_prefix_caching=false"]), str(moe_dir))
    check_routing_replay(load_config(on), str(moe_dir))  # local engines, CPU or CUDA: nothing to refuse
    check_routing_replay(load_config([*on, "generator.run_engines_locally=false"]), str(moe_dir))
    check_routing_replay(load_config([]), str(dense))  # off: nothing checked


def test_the_key_starts_engines_with_vllms_capture_and_tells_the_generator() -> None:
    from skylift.cluster.settings import generator_settings, local_engine_kwargs

    cfg = load_config(["generator.enable_return_routed_experts=true"])
    assert local_engine_kwargs(cfg, sleep_mode=False)["enable_return_routed_experts"] is True
    assert generator_settings(cfg).routed_experts is True
    skyrl = load_config(["generator.inference_engine.enable_return_routed_experts=true"])  # SkyRL's layout
    assert skyrl.generator.enable_return_routed_experts is True
    off = load_config([])
    assert "enable_return_routed_experts" not in local_engine_kwargs(off, sleep_mode=False)
    assert generator_settings(off).routed_experts is False


def test_skylift_serve_says_in_one_line_what_vllms_config_check_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Routed experts of a dense model: vLLM's config check refuses them (a pydantic error of some
    60 lines before); the server says so in one line and starts nothing."""
    import os

    from skylift.inference.server import main
    from skylift.weight_sync.process_group import find_free_port

    saved = dict(os.environ)
    port = str(find_free_port())
    try:
        code = main([str(prepare_model("tiny-qwen2")), "--enable-return-routed-experts", "--port", port])
    finally:  # the server's set-up exports its settings for the engine's processes
        os.environ.clear()
        os.environ.update(saved)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == (
        "skylift serve: vLLM refused the engine's configuration: AuxOutput Connector only supports MoE models"
    )
