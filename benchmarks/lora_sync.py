"""LoRA weight sync benchmark: a rank-32 adapter sync against a full-model sync, on SmolLM2-135M.

In one run, with in-process vLLM engines (fp32, as `benchmarks/weight_sync.py`):

Both engines run eager (vLLM's CPU backend compiles nothing for a LoRA engine):

1. an engine without LoRA: the full-model sync (`WeightSender.send_state_dict` of every tensor,
   until loaded and the prefix cache reset: what skylift did for a LoRA policy before, merged),
   and generation throughput of the base model;
2. an engine started with LoRA (max_lora_rank 32): the adapter sync (`LoraPublisher.publish` in
   memory over the weight-update group: packed, broadcast, and installed by the workers from the
   received tensors as a new named adapter, the version two syncs old unloaded in the same call),
   checked against the PEFT model's logprobs, and generation throughput with the adapter (and of
   the base model on that engine). Its breakdown: the sender's packing (timed alone, the same
   function), the worker's parts (receive = the broadcast, build, add, activate; reported by the
   worker) and the rest (control round trip, threads, event loop).

A warm-up sync, then `--repeats` syncs (median); then a short warm-up generation and
`--gen-rounds` generation rounds. Last stdout line, one JSON object:
    {"ratio": lora_sync_s / full_sync_s, "throughput_ratio": tok/s with adapter / tok/s without, ...}

Run inside a loopback-only network namespace (gloo's store listens on all interfaces):
    unshare -n sh -c 'ip link set lo up; .venv/bin/python benchmarks/lora_sync.py'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from _servers import set_benchmark_env

set_benchmark_env()

import torch  # noqa: E402

SEQUENCE = [5, 17, 230, 99, 42, 8, 77, 301, 12, 64, 7, 1000, 33]
# eager on both sides: vLLM's CPU backend turns compilation off for an engine with LoRA anyway, so
# the throughput ratio compares like with like (and start-up skips minutes of compiling)
ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 512,
    "dtype": "float32",
    "seed": 0,
    "max_num_seqs": 16,
    "enforce_eager": True,
}


def peft_policy(model_dir: Any, rank: int) -> Any:
    """The base model with a rank-`rank` adapter on every linear layer, random (non-zero) weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model


def adapter_of(model: Any) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    from peft import get_peft_model_state_dict

    tensors = [(k, v.detach()) for k, v in get_peft_model_state_dict(model).items()]
    return tensors, model.peft_config["default"].to_dict()


def logprob_error(engine_lp: list[float], model: Any) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQUENCE])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    ref = [logp[i - 1, t].item() for i, t in enumerate(SEQUENCE) if i > 0]
    return max(abs(a - b) for a, b in zip(engine_lp, ref, strict=True))


async def throughput(engine: Any, prompts: int, tokens: int, lora_name: str | None = None) -> float:
    """Sampled tokens per second of `prompts` concurrent requests of `tokens` tokens each."""
    from skylift.inference.types import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0, temperature=1.0)
    batch = [[5 + i, 17, 230, 99, 42 + i] for i in range(prompts)]
    start = time.perf_counter()
    outputs = await engine.generate(batch, params, lora_name=lora_name)
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for o in outputs for c in o.completions) / seconds


async def full_sync_round(args: argparse.Namespace, model_dir: Any, state: list) -> dict[str, Any]:
    from skylift.inference.local import LocalVLLMEngine
    from skylift.weight_sync import WeightSender

    engine = await LocalVLLMEngine.create(str(model_dir), name="base-engine", **ENGINE_ARGS)
    try:
        sender = WeightSender(timeout_s=120.0)
        await sender.init_group([engine])
        await sender.send_state_dict(state)  # warm-up
        times, stats = [], None
        for _ in range(args.repeats):
            stats = await sender.send_state_dict(state)
            times.append(stats.seconds)
        await sender.close()
        await throughput(engine, 2, 4)  # warm-up
        tput = [await throughput(engine, args.prompts, args.tokens) for _ in range(args.gen_rounds)]
    finally:
        await engine.close()
    assert stats is not None
    return {
        "full_sync_s": statistics.median(times),
        "full_bytes": stats.bytes,
        "base_tok_s": statistics.median(tput),
    }


async def lora_sync_round(args: argparse.Namespace, model_dir: Any, model: Any) -> dict[str, Any]:
    from skylift.inference.engine_args import lora_engine_args
    from skylift.inference.local import LocalVLLMEngine
    from skylift.weight_sync import WeightSender
    from skylift.weight_sync.lora.adapter import LoraPublisher, pack_adapter

    tensors, config = adapter_of(model)
    engine = await LocalVLLMEngine.create(
        str(model_dir), name="lora-engine", **ENGINE_ARGS, **lora_engine_args(args.rank)
    )
    try:
        sender = WeightSender(timeout_s=120.0)
        await sender.init_group([engine])
        publisher = LoraPublisher()
        assert sender.group is not None

        async def sync() -> Any:
            return await publisher.publish([engine], tensors, config, group=sender.group, timeout_s=300.0)

        await sync()  # warm-up
        times, stats, parts = [], None, []
        for _ in range(args.repeats):
            stats = await sync()
            times.append(stats.seconds)
            parts.append(engine.lora.last_receive[0])
        packing = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            pack_adapter(tensors, torch.device("cpu"))
            packing.append(time.perf_counter() - start)
        await throughput(engine, 2, 4)  # warm-up
        with_adapter, base_on_lora_engine = [], []
        for _ in range(args.gen_rounds):
            with_adapter.append(await throughput(engine, args.prompts, args.tokens))
            base_on_lora_engine.append(await throughput(engine, args.prompts, args.tokens, lora_name=""))
        error = logprob_error((await engine.prompt_logprobs([SEQUENCE]))[0], model)
        await sender.close()
    finally:
        await engine.close()
    assert stats is not None
    if not error < 1e-3:
        raise SystemExit(f"the engine does not serve the synced adapter (max logprob error {error:.2e})")
    breakdown = {"sender_pack": statistics.median(packing)}
    breakdown.update({f"worker_{k[:-2]}": statistics.median(p[k] for p in parts) for k in parts[0]})
    breakdown["rest"] = statistics.median(times) - sum(breakdown.values())
    return {
        "lora_sync_breakdown_ms": {k: round(1e3 * v, 1) for k, v in breakdown.items()},
        "lora_sync_s": statistics.median(times),
        "lora_bytes": stats.bytes,
        "lora_tensors": stats.tensors,
        "adapter_tok_s": statistics.median(with_adapter),
        "lora_engine_base_tok_s": statistics.median(base_on_lora_engine),
        "logprob_err_with_adapter": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--gen-rounds", type=int, default=1, help="generation rounds per engine")
    args = parser.parse_args()
    from skylift.models import prepare_model

    model_dir = prepare_model(args.model)
    model = peft_policy(model_dir, args.rank)
    # the full sync moves every tensor of the model (the names and sizes a merged sync sends)
    state = [
        (k.replace(".base_layer", ""), v.detach().clone())
        for k, v in model.get_base_model().state_dict().items()
        if "lora_" not in k
    ]
    full = asyncio.run(full_sync_round(args, model_dir, state))
    lora = asyncio.run(lora_sync_round(args, model_dir, model))
    result = {
        "model": args.model,
        "rank": args.rank,
        "ratio": round(lora["lora_sync_s"] / full["full_sync_s"], 4),
        "throughput_ratio": round(lora["adapter_tok_s"] / full["base_tok_s"], 3),
        "full_sync_s": round(full["full_sync_s"], 4),
        "full_bytes": full["full_bytes"],
        "lora_sync_s": round(lora["lora_sync_s"], 4),
        "lora_bytes": lora["lora_bytes"],
        "lora_tensors": lora["lora_tensors"],
        "lora_sync_breakdown_ms": lora["lora_sync_breakdown_ms"],
        "base_tok_s": round(full["base_tok_s"], 1),
        "adapter_tok_s": round(lora["adapter_tok_s"], 1),
        "lora_engine_base_tok_s": round(lora["lora_engine_base_tok_s"], 1),
        "logprob_err_with_adapter": lora["logprob_err_with_adapter"],
        "repeats": args.repeats,
        "gen_rounds": args.gen_rounds,
        "generation": f"{args.prompts} prompts x {args.tokens} tokens",
    }
    print(
        f"{args.model}: rank-{args.rank} adapter {result['lora_bytes'] / 1e6:.1f} MB synced in "
        f"{1e3 * result['lora_sync_s']:.0f} ms vs full model {result['full_bytes'] / 1e6:.0f} MB in "
        f"{1e3 * result['full_sync_s']:.0f} ms (ratio {result['ratio']:.3f}); generation "
        f"{result['adapter_tok_s']:.0f} tok/s with the adapter vs {result['base_tok_s']:.0f} without "
        f"({result['throughput_ratio']:.2f}x; base model on the LoRA engine {result['lora_engine_base_tok_s']:.0f})",
        flush=True,
    )
    print(
        "adapter sync breakdown (ms, medians): "
        + ", ".join(f"{k} {v}" for k, v in result["lora_sync_breakdown_ms"].items()),
        flush=True,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
