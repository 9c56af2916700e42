"""Every change skylift makes to vLLM's behaviour, and every vLLM bug it routes around, in one folder.

Each module is one patch: its docstring names the upstream bug and the condition that makes it
removable; ``NAME`` and ``WRITTEN_FOR`` (a PEP 440 specifier) say which vLLM it was written for,
and its ``install`` goes through `versions.guard` first, so a vLLM outside that range fails at
start-up with a message naming the patch (``SKYLIFT_UNTESTED_VLLM=1`` tries it anyway). A
workaround that changes no vLLM code (`lora_prompt_logprobs`: a bug skylift routes around) has no
``install``; `check` guards its version all the same.

| patch | where it is installed | what it does |
|---|---|---|
| `cpu_seed_rewind` | every engine worker (`skylift.inference.vllm_worker`) | seeded requests on CPU survive the rewind of a discarded chunked-prefill sample |
| `prompt_logprobs_lora_rows` | every engine worker (`skylift.inference.vllm_worker`) | prompt logprobs in a LoRA engine add no unembedding delta (CPU and CUDA, V1 and V2 runners) instead of killing the engine (CPU) or adding other requests' adapters to some rows (CUDA) |
| `cpu_lora_no_adapter` | every engine worker (`skylift.inference.vllm_worker`) | on CPU, tokens without an adapter get no adapter's delta (vLLM's torch ops read index -1 as the last slot) |
| `cpu_moe_reload` | every engine worker (`skylift.inference.vllm_worker`) | on CPU, a weight update of a mixture-of-experts layer repacks the experts (vLLM copies them unpacked into the packed storage) |
| `cpu_routed_experts` | every engine worker (`skylift.inference.vllm_worker`), and its config half where a routing-replay engine's config is built (`skylift.inference.engine_args.prepare_routed_experts`) | on CPU, the V1 model runner returns each token's routed experts with vLLM's own capture (vLLM wires it to its V2 runner only, which needs Triton) |
| `quiet_teardown` | the driver, before an in-process `AsyncLLM` starts (`skylift.inference.local`) | no spurious TypeError from `AsyncLLM.__del__` at exit |
| `quiet_dead_core` | the driver or engine actor, before an in-process `AsyncLLM` starts (`skylift.inference.local`) | a dead engine core is one log line, not the output handler's traceback |
| `responses_input` | `skylift serve` (`skylift.inference.server`) | Responses inputs vLLM's parser crashes on get a 400 |
| `generate_guard` (+ `generate_body`) | `skylift serve --enable-scale-out` (`skylift.inference.routes`) | ``/inference/v1/generate`` bodies checked before vLLM reads them |
| `qwen2_vl_site` (+ `qwen2_vl_without_torchvision/`) | a vision-language run or the Tinker render server, before vLLM starts (`skylift.cluster.vision_run`, `skylift.tinker.vision.render_server`) | Qwen2-VL loads without torchvision (transformers' PIL image processor; no video processor) |
| `start_cause` | every vLLM process, as a general plugin (pyproject's `vllm.general_plugins`); read by `skylift.inference.local` | an engine that fails to start says why in the starting process's error, not only in a child's log |
| `lora_prompt_logprobs` | asked by the Tinker sampler (`skylift.tinker.sampling.engine_host`) | prompt scoring under an adapter of the unembedding runs on merged weights (vLLM drops or crashes on it) |

`check` guards all of them at once: the engine and the server call it before vLLM starts, so the
version message comes from the process the user started, not from a dying worker.
"""

from __future__ import annotations

from skylift.inference.vllm_patches import (
    cpu_lora_no_adapter,
    cpu_moe_reload,
    cpu_routed_experts,
    cpu_seed_rewind,
    generate_guard,
    lora_prompt_logprobs,
    prompt_logprobs_lora_rows,
    quiet_dead_core,
    quiet_teardown,
    qwen2_vl_site,
    responses_input,
    start_cause,
)
from skylift.inference.vllm_patches.versions import (
    VllmPatchVersionError,
    guard_all,
    installed_vllm_version,
    pinned_vllm_version,
)

#: every patch module, in the table's order
MODULES = (
    cpu_seed_rewind,
    cpu_lora_no_adapter,
    prompt_logprobs_lora_rows,
    cpu_moe_reload,
    cpu_routed_experts,
    quiet_teardown,
    quiet_dead_core,
    responses_input,
    generate_guard,
    lora_prompt_logprobs,
    qwen2_vl_site,
    start_cause,
)
#: (name, the vLLM versions it was written for) of every patch.
PATCHES: tuple[tuple[str, str], ...] = tuple((module.NAME, module.WRITTEN_FOR) for module in MODULES)

__all__ = [
    "MODULES",
    "PATCHES",
    "VllmPatchVersionError",
    "check",
    "installed_vllm_version",
    "pinned_vllm_version",
]


def check(version: str | None = None) -> None:
    """`VllmPatchVersionError` unless every patch was written for the installed vLLM (or `version`);
    the message names each patch that does not fit."""
    guard_all(list(PATCHES), version=version)
