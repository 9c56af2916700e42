"""A LoRA policy syncs its adapter, except over a mixture-of-experts model
(`skylift.cluster.lora_run`): there the engines start without LoRA and get merged weights."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from skylift.cluster.lora_run import lora_sync
from skylift.cluster.settings import local_engine_kwargs
from skylift.config import load_config
from skylift.weight_sync.factory import make_transport
from skylift.weight_sync.lora.transport import LoraTransport
from skylift.weight_sync.placed import PlacedTransport

SMALL = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("configs")
    moe, dense = root / "moe", root / "dense"
    Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8).save_pretrained(
        moe
    )
    LlamaConfig(**SMALL, intermediate_size=32).save_pretrained(dense)
    return {"moe": str(moe), "dense": str(dense)}


def _cfg(*overrides: str) -> Any:
    return load_config(["trainer.policy.model.lora.rank=8", *overrides])


def test_a_lora_policy_syncs_its_adapter_unless_it_is_a_mixture_of_experts(models: dict[str, str]) -> None:
    assert lora_sync(_cfg(), models["dense"]).adapter
    remote = _cfg("generator.run_engines_locally=false")
    assert lora_sync(remote, models["dense"]).adapter
    for cfg in (_cfg(), remote):  # local or remote engines, CPU or GPU: merged weights, and why
        plan = lora_sync(cfg, models["moe"])
        assert not plan.adapter and plan.line is not None and "mixture-of-experts" in plan.line


def test_a_policy_without_lora_syncs_no_adapter(models: dict[str, str]) -> None:
    plan = lora_sync(load_config([]), models["moe"])
    assert not plan.adapter and plan.line is None


def test_engines_start_with_lora_only_for_an_adapter_sync() -> None:
    cfg = _cfg()
    assert local_engine_kwargs(cfg, sleep_mode=False)["enable_lora"] is True
    assert "enable_lora" not in local_engine_kwargs(cfg, sleep_mode=False, lora_adapter=False)


def test_the_transport_follows_the_plan() -> None:
    cfg = _cfg()
    say: list[str] = []
    adapter = make_transport(cfg, object(), [], say.append)  # its group chosen at open, by places
    assert isinstance(adapter, PlacedTransport) and adapter.adapter
    assert isinstance(adapter.build("nccl", []), LoraTransport)
    merged = make_transport(cfg, object(), [], say.append, lora_adapter=False)
    assert isinstance(merged, PlacedTransport)
    # shared memory carries full weights: allowed for merged weights, refused for an adapter
    forced = _cfg("generator.weight_sync_backend=ipc")
    assert isinstance(make_transport(forced, object(), [], say.append, lora_adapter=False), PlacedTransport)
    with pytest.raises(Exception, match="LoRA policy syncs its adapter"):
        make_transport(forced, object(), [], say.append)
