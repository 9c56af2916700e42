"""Staging of fused-module parts for per-parameter weight updates (SkyRL's protocol)."""

from __future__ import annotations

import pytest
import torch

from skylift.weight_sync.broadcast.fused_staging import FusedStager, IncompleteModuleError, LoadUnits

# The load units of a two-layer Qwen2-like vLLM model: q/k/v (weights and biases) fuse into
# qkv_proj, gate/up into gate_up_proj.
UNITS = LoadUnits(
    packed={"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
    params={
        "model.embed_tokens": ["weight"],
        **{f"model.layers.{i}.self_attn.qkv_proj": ["weight", "bias"] for i in range(2)},
        **{f"model.layers.{i}.self_attn.o_proj": ["weight"] for i in range(2)},
        **{f"model.layers.{i}.mlp.gate_up_proj": ["weight"] for i in range(2)},
        **{f"model.layers.{i}.mlp.down_proj": ["weight"] for i in range(2)},
        "model.norm": ["weight"],
    },
)


def hf_names(layer: int) -> list[str]:
    p = f"model.layers.{layer}"
    return [
        *(f"{p}.self_attn.{x}_proj.{k}" for x in "qkv" for k in ("weight", "bias")),
        f"{p}.self_attn.o_proj.weight",
        f"{p}.mlp.gate_proj.weight",
        f"{p}.mlp.up_proj.weight",
        f"{p}.mlp.down_proj.weight",
    ]


def one(name: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(1))]


def test_units_and_expected_parts() -> None:
    assert UNITS.unit_of("model.layers.1.self_attn.k_proj.bias") == "model.layers.1.self_attn.qkv_proj"
    assert UNITS.unit_of("model.layers.1.mlp.down_proj.weight") == "model.layers.1.mlp.down_proj"
    assert len(UNITS.expected("model.layers.0.self_attn.qkv_proj") or []) == 6
    assert UNITS.expected("model.layers.0.mlp.gate_up_proj") == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    partial = UNITS.partial_units(["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"])
    assert list(partial) == ["model.layers.0.self_attn.qkv_proj"]


def test_parts_are_staged_until_the_module_is_complete() -> None:
    stager = FusedStager(UNITS)
    loaded: list[list[str]] = []
    for name in ["model.embed_tokens.weight", *hf_names(0), *hf_names(1), "model.norm.weight"]:
        ready = stager.add(one(name))
        if ready:
            loaded.append([n for n, _ in ready])
    assert stager.pending() is None
    qkv0 = next(batch for batch in loaded if "model.layers.0.self_attn.q_proj.weight" in batch)
    assert sorted(qkv0) == sorted(hf_names(0)[:6])  # all six parts in one load
    flat = [n for batch in loaded for n in batch]
    assert sorted(flat) == sorted(
        ["model.embed_tokens.weight", *hf_names(0), *hf_names(1), "model.norm.weight"]
    )


def test_moving_past_an_incomplete_module_names_what_is_missing() -> None:
    stager = FusedStager(UNITS)
    for name in hf_names(0)[:4]:  # q and k, no v
        assert stager.add(one(name)) == []
    with pytest.raises(IncompleteModuleError) as info:
        stager.add(one("model.layers.1.self_attn.q_proj.weight"))
    message = str(info.value)
    assert "model.layers.0.self_attn.qkv_proj incomplete" in message
    assert "model.layers.0.self_attn.v_proj.weight" in message and "v_proj.bias" in message
    assert "moved on to model.layers.1" in message
    assert stager.pending() is None  # the stale parts were dropped, never loaded


def test_pending_parts_are_reported_and_a_repeat_is_refused() -> None:
    stager = FusedStager(UNITS)
    stager.add(one("model.layers.1.mlp.gate_proj.weight"))
    assert "missing ['model.layers.1.mlp.up_proj.weight']" in (stager.pending() or "")
    with pytest.raises(IncompleteModuleError, match="arrived twice"):
        stager.add(one("model.layers.1.mlp.gate_proj.weight"))
