"""Hybrid sharding (SkyRL's `trainer.<model>.fsdp_config.fsdp_size`): FSDP2 over a 2-D device mesh,
shard groups of `fsdp_size` ranks replicated across the others. Two gloo ranks in replicas of one
shard each take one update equal to a single rank's on the whole batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_two_ranks
from server_helpers import require_loopback_namespace
from tolerances import sum_tolerance

from skylift.algorithms import mini_batch_totals
from skylift.config import ConfigError, load_config
from skylift.config.schema import OptimizerConfig
from skylift.rl.objective import PolicyObjective
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.sharding import hybrid_mesh
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

# One rank of a 2-rank policy group with fsdp_size=1: trains its half of the batch (the worker
# group's contiguous shards), then rank 0 writes the full weights and the mesh it sharded over.
RANK = r"""
import json, sys, torch
from skylift.config.schema import OptimizerConfig
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings
rank, rdzv, model_dir, inputs, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
batch, objective = torch.load(inputs, weights_only=False)
settings = WorkerSettings(model_path=model_dir, fsdp_size=1, optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0))
w = TrainingWorker(settings, rank=rank, world_size=2, init_method=rdzv)
w.setup()
param = next(w.model.parameters())
mesh = {"shape": list(param.device_mesh.shape), "names": list(param.device_mesh.mesh_dim_names),
        "placements": [type(p).__name__ for p in param.placements]}
half = batch.batch_size // 2
w.train_mini_batch(batch.select(list(range(rank * half, (rank + 1) * half))), objective, micro_batch_size=2)
weights = {k: v.clone() for k, v in w.iter_full_weights()}
if rank == 0:
    torch.save(weights, out + ".pt")
    open(out + ".json", "w").write(json.dumps(mesh))
w.shutdown()
"""


def _batch(vocab: int, rows: int = 8, seed: int = 3) -> SequenceBatch:
    gen = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=gen))
        return torch.randint(5, vocab, (length,), generator=gen).tolist()

    batch = build_sequence_batch(
        [ids(3, 9) for _ in range(rows)], [ids(1, 7) for _ in range(rows)], pad_token_id=0
    )
    advantages = torch.randn(rows, 1, generator=gen).expand(-1, batch.response_len) * batch.response_mask
    return batch.with_extras(advantages=advantages.contiguous())


def test_hybrid_sharding_update_equals_one_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_loopback_namespace()  # two gloo ranks listen on every interface
    batch = _batch(vocab=500)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    torch.save((batch, objective), tmp_path / "inputs.pt")
    rdzv, out = f"file://{tmp_path / 'rdzv'}", str(tmp_path / "hybrid")
    args = [str(tiny_model_dir), str(tmp_path / "inputs.pt"), out]
    run_two_ranks(RANK, rdzv, args)
    mesh = json.loads(Path(out + ".json").read_text())
    assert mesh == {"shape": [2, 1], "names": ["replicate", "shard"], "placements": ["Replicate", "Shard"]}
    hybrid = torch.load(out + ".pt")

    single = TrainingWorker(
        WorkerSettings(
            model_path=str(tiny_model_dir),
            optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0),
        ),
        init_method=f"file://{tmp_path / 'rdzv1'}",
    )
    single.setup()
    start = {k: v.detach().clone() for k, v in single.iter_full_weights()}
    single.train_mini_batch(batch, objective, micro_batch_size=2)
    reference = {k: v.detach().clone() for k, v in single.iter_full_weights()}
    single.shutdown()
    # as in test_training_worker's micro-batch check: eps=1 makes the update ~ lr * grad, a sum of
    # one term per token at its module's scale; the two runs add them in another order
    tokens = int(batch.attention_mask.sum())
    scale: dict[str, float] = {}
    for name, weight in start.items():
        module = name.rsplit(".", 1)[0]
        scale[module] = max(scale.get(module, 0.0), float((reference[name] - weight).abs().max()))
    assert max(scale.values()) > 0
    for name, weight in start.items():
        tol = sum_tolerance(scale[name.rsplit(".", 1)[0]], tokens)
        tol += torch.finfo(weight.dtype).eps * float(weight.abs().max())
        worst = float((hybrid[name] - reference[name]).abs().max())
        assert worst <= tol, (name, worst, tol)


def test_fsdp_size_must_divide_the_workers() -> None:
    assert hybrid_mesh(4, -1, "cpu") is None and hybrid_mesh(4, 4, "cpu") is None  # shard over all
    with pytest.raises(ValueError, match="fsdp_size=3 must divide the 4 ranks"):
        hybrid_mesh(4, 3, "cpu")
    cfg = load_config(
        ["trainer.placement.policy_num_gpus_per_node=4", "trainer.policy.fsdp_config.fsdp_size=2"]
    )
    assert cfg.trainer.policy.fsdp_config.fsdp_size == 2
    with pytest.raises(
        ConfigError, match=r"trainer.policy.fsdp_config.fsdp_size=3 must be -1 .* divides the policy's 4"
    ):
        load_config(
            ["trainer.placement.policy_num_gpus_per_node=4", "trainer.policy.fsdp_config.fsdp_size=3"]
        )
    with pytest.raises(ConfigError, match=r"trainer.critic.fsdp_config.fsdp_size=0 must be -1"):
        load_config(["trainer.critic.fsdp_config.fsdp_size=0"])
