"""Routing replay (`skylift.worker.routing_replay`): a forward whose MoE routers pick given experts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from skylift.worker.routing_replay import RoutingReplayError, moe_routers, replay_routing, routing_of

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)
FAMILIES: dict[str, Any] = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **TINY,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "mixtral": lambda: MixtralConfig(
        **TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    ),
    "olmoe": lambda: OlmoeConfig(**TINY, intermediate_size=32, num_experts=6, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **TINY,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    ),
}
TORCH_TOPK = torch.topk
IDS = torch.tensor([[3, 17, 5, 60, 2, 9, 33], [8, 8, 41, 12, 7, 1, 50]])


def _model(family: str) -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replaying_the_models_own_routing_changes_nothing(family: str) -> None:
    model = _model(family)
    routed = routing_of(model, input_ids=IDS)
    assert routed.shape[:2] == (IDS.numel(), 3)
    with torch.no_grad():
        plain = model(input_ids=IDS).logits
        with replay_routing(model, routed):
            replayed = model(input_ids=IDS).logits
    assert torch.equal(plain, replayed)
    assert torch.topk is TORCH_TOPK  # restored after the block


@pytest.mark.parametrize("family", list(FAMILIES))
def test_given_routing_is_used_in_every_moe_layer_and_the_router_still_learns(family: str) -> None:
    model = _model(family)
    own = routing_of(model, input_ids=IDS)
    experts = moe_routers(model)[max(moe_routers(model))].num_experts
    other = (own + 1) % experts  # every token to other experts
    with replay_routing(model, other):
        assert torch.equal(_picked(model), other[:, sorted(moe_routers(model))])
        loss = model(input_ids=IDS).logits.logsumexp(-1).mean()
    loss.backward()
    for router in moe_routers(model).values():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with torch.no_grad():
        plain = model(input_ids=IDS).logits
        with replay_routing(model, other):
            assert not torch.allclose(model(input_ids=IDS).logits, plain)
    assert torch.equal(routing_of(model, input_ids=IDS), own)  # the patch is gone after the block


def _picked(model: Any) -> torch.Tensor:
    picked: dict[int, torch.Tensor] = {}
    handles = [
        r.register_forward_hook(lambda m, a, out, i=i: picked.__setitem__(i, out[2]))
        for i, r in moe_routers(model).items()
    ]
    with torch.no_grad():
        model(input_ids=IDS)
    for h in handles:
        h.remove()
    return torch.stack([picked[i] for i in sorted(picked)], dim=1)


def test_routing_that_does_not_fit_is_a_one_line_error() -> None:
    model = _model("mixtral")
    with pytest.raises(RoutingReplayError, match="do not cover the 3 layers"):
        with replay_routing(model, torch.zeros(IDS.numel(), 2, 2, dtype=torch.long)):
            pass
    with pytest.raises(RoutingReplayError, match="scores 14 tokens but 5"):
        with replay_routing(model, torch.zeros(5, 3, 2, dtype=torch.long)):
            model(input_ids=IDS)
    dense = AutoModelForCausalLM.from_config(
        Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"}, intermediate_size=32)
    )
    with pytest.raises(RoutingReplayError, match="has no mixture-of-experts router"):
        with replay_routing(dense, torch.zeros(1, 3, 2, dtype=torch.long)):
            pass


def test_a_replay_does_not_reach_another_threads_routers() -> None:
    """While one thread replays a routing, a forward of another model in another thread routes as
    itself (the replayed top-k answers only in the thread whose router runs under the replay)."""
    import threading

    replayed_model, other = _model("qwen3_moe"), _model("mixtral")
    own = routing_of(other, input_ids=IDS)
    given = (routing_of(replayed_model, input_ids=IDS) + 1) % 6
    seen: list[bool] = []
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            for _ in range(40):
                seen.append(torch.equal(routing_of(other, input_ids=IDS), own))
        except BaseException as exc:  # a routing meant for the other model's tokens
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    with replay_routing(replayed_model, given):
        thread.start()
        while thread.is_alive():
            with torch.no_grad():
                replayed_model(input_ids=IDS)
    thread.join()
    assert not errors and seen and all(seen)
