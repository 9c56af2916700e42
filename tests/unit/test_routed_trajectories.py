"""A trajectory's routed experts aligned with its ids (`skylift.generator.routed`): a continued
sample, step-wise samples (merged or not) and a turn an environment rewrote."""

from __future__ import annotations

import numpy as np
import pytest

from skylift.generator.generator import join_completions
from skylift.generator.rollout_end import RolloutRecord
from skylift.generator.routed import overlay
from skylift.generator.settings import GeneratorSettings
from skylift.generator.step_wise import Step, step_trajectories
from skylift.inference.types import Completion, EngineError


class _Row:
    uid, data_source = "row", "test"


def _routing(length: int, start: int = 0) -> np.ndarray:
    """Token j routed to experts (start + j, start + j + 1) in each of 2 layers."""
    j = np.arange(start, start + length)
    return np.stack([np.stack([j, j + 1], -1)] * 2, axis=1).astype(np.uint8)


def test_overlay_takes_the_later_rows_and_marks_the_rest() -> None:
    out = overlay(_routing(3, 50), _routing(5), 7)
    assert out is not None and out.dtype == np.int16 and out.shape == (7, 2, 2)
    assert np.array_equal(out[:5], _routing(5)) and (out[5:] == -1).all()
    assert overlay(None, None, 4) is None
    with pytest.raises(EngineError, match="the engine routed 5 tokens .* but the sequence has 4"):
        overlay(None, _routing(5), 4)


def test_a_continued_sample_keeps_the_continuations_routing() -> None:
    first = Completion([7, 8], None, "abort", routed_experts=_routing(3))
    rest = Completion([9], None, "stop", routed_experts=_routing(4, 10))
    assert np.array_equal(join_completions(first, rest).routed_experts, _routing(4, 10))
    assert np.array_equal(join_completions(first, Completion([9], None, "stop")).routed_experts, _routing(3))


def test_step_wise_samples_and_their_merge_carry_their_steps_routing() -> None:
    # step 1: prompt [1, 2], sampled [3, 4]; step 2: prompt = step 1 + [5], sampled [6, 7]
    steps = [
        Step([1, 2], [3, 4], [0.0, 0.0], None, "stop", "a", _routing(3)),
        Step([1, 2, 3, 4, 5], [6, 7], [0.0, 0.0], None, "stop", "b", _routing(6, 20)),
    ]
    split = step_trajectories(_Row(), steps, 1.0, "r", 0, overlong_filtering=False, metadata={}, metrics={})
    assert [tr.routed_experts.shape[0] for tr in split] == [4, 7]
    assert (split[0].routed_experts[3] == -1).all() and np.array_equal(
        split[0].routed_experts[:3], _routing(3)
    )
    (merged,) = step_trajectories(
        _Row(), steps, 1.0, "r", 0, overlong_filtering=False, metadata={}, metrics={}, merge=True
    )
    assert merged.prompt_ids + merged.response_ids == [1, 2, 3, 4, 5, 6, 7]
    assert (
        np.array_equal(merged.routed_experts[:6], _routing(6, 20)) and (merged.routed_experts[6] == -1).all()
    )


def test_a_rewritten_turn_drops_the_routing_of_ids_the_engine_never_ran() -> None:
    settings = GeneratorSettings(routed_experts=True)
    rollout = RolloutRecord([1, 2], 0)
    rollout.add_turn(settings, [1, 2], Completion([3, 4, 5], None, "stop", routed_experts=_routing(4)), "x")
    rollout.replace_turn([3, 4, 5], [3, 9], "y")  # the environment rewrote the turn after token 3
    (tr,) = rollout.finish(_Row(), settings)
    assert tr.prompt_ids + tr.response_ids == [1, 2, 3, 9]
    assert np.array_equal(tr.routed_experts[:3], _routing(3)) and (tr.routed_experts[3] == -1).all()


def test_a_gateway_calls_routing_reaches_its_step() -> None:
    from skylift.gateway.session import Budget, CallRecord, Session
    from skylift.gateway.trajectories import session_trajectories
    from skylift.inference.types import SamplingParams

    session = Session(SamplingParams(), 0, Budget())
    session.calls.append(
        CallRecord([1, 2], [3, 4], [0.0, 0.0], "stop", 0, None, "x", routed_experts=_routing(3))
    )
    (tr,) = session_trajectories(_Row(), session, 1.0, "r", stand_in_prompt=[1], stand_in_token=2)
    assert np.array_equal(tr.routed_experts[:3], _routing(3)) and (tr.routed_experts[3] == -1).all()
