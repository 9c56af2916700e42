"""`skylift train generator.sampling_params.min_p=0.1` (and repetition_penalty) reach the engines:
the trainer's sampling parameters, the vLLM SamplingParams a local engine builds, and the JSON a
remote engine is sent (decoded by the server's codec into vLLM's SamplingParams again)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from skylift.config import load_config
from skylift.data import PromptSample
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.generator import rollout_seed
from skylift.inference.types import SamplingParams
from skylift.rl.sampling import sampling_params

OVERRIDES = [
    "generator.sampling_params.min_p=0.1",
    "generator.sampling_params.repetition_penalty=1.3",
    "generator.eval_sampling_params.min_p=0.05",
    "generator.eval_sampling_params.repetition_penalty=1.1",
]


def _trainer_params(overrides: list[str]) -> tuple[SamplingParams, SamplingParams]:
    """What the trainer's rollouts and evaluations ask the engines for under `skylift train <overrides>`."""
    cfg = load_config(overrides)
    return sampling_params(cfg, evaluation=False), sampling_params(cfg, evaluation=True)


def test_the_trainer_asks_the_engines_for_the_configured_min_p_and_penalty() -> None:
    train, evaluation = _trainer_params(OVERRIDES)
    assert (train.min_p, train.repetition_penalty) == (0.1, 1.3)
    assert (evaluation.min_p, evaluation.repetition_penalty) == (0.05, 1.1)
    default_train, default_eval = _trainer_params([])
    assert (default_train.min_p, default_train.repetition_penalty) == (0.0, 1.0)
    assert (default_eval.min_p, default_eval.repetition_penalty) == (0.0, 1.0)


def test_the_local_engine_builds_vllm_params_with_them() -> None:
    from skylift.inference.local import to_vllm_params  # the local engine's one builder

    train, _ = _trainer_params(OVERRIDES)
    vllm_params = to_vllm_params(train)
    assert vllm_params.min_p == 0.1
    assert vllm_params.repetition_penalty == 1.3


def test_a_remote_engine_is_sent_them_and_the_server_passes_them_to_vllm(tiny_model_dir: Path) -> None:
    """The generator drives a real `RemoteInferenceEngine` against a loopback server that records
    the request; the server's own codec turns the recorded JSON into vLLM's SamplingParams."""
    from aiohttp import web
    from transformers import AutoTokenizer

    from skylift.inference.bodies import GenerateBody
    from skylift.inference.http_session import SessionPool
    from skylift.inference.local import to_vllm_params
    from skylift.inference.remote import RemoteInferenceEngine

    train, _ = _trainer_params(OVERRIDES)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    received: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        received.append(body)
        n = body["sampling_params"]["n"]
        comp = {"token_ids": [5, 6], "logprobs": [-0.5, -0.25], "stop_reason": "stop", "text": None}
        outputs = [{"prompt_token_ids": p, "completions": [comp] * n} for p in body["prompt_token_ids"]]
        return web.json_response({"outputs": outputs})

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/skylift/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        pool = SessionPool(limit=4, keepalive=1.0)
        engine = RemoteInferenceEngine(f"127.0.0.1:{port}", max_retries=0, session_pool=pool)
        row = PromptSample(
            prompt=[{"role": "user", "content": "1 + 1 = ?"}],
            env_class="gsm8k",
            reward_spec={"method": "rule", "ground_truth": "2"},
            extra_info={},
            data_source="test",
            uid="0:0",
        )
        try:
            generator = Generator(engine, tokenizer, GeneratorSettings(max_generate_length=8))
            trajectories = await generator.generate([row], 2, train, seeds=[rollout_seed(1, 0, row.uid)])
            assert len(trajectories) == 2
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(run())
    assert len(received) == 1
    sent = received[0]["sampling_params"]
    assert (sent["min_p"], sent["repetition_penalty"]) == (0.1, 1.3)
    # the server's route decodes the body into our SamplingParams, which its engine hands to vLLM
    decoded = GenerateBody.model_validate(received[0]).sampling_params
    vllm_params = to_vllm_params(SamplingParams(**decoded.model_dump()))
    assert vllm_params.min_p == 0.1
    assert vllm_params.repetition_penalty == 1.3
