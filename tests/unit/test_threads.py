"""The GIL switch interval overlapped training runs with (`skylift.utils.threads`)."""

from __future__ import annotations

import sys

import pytest

from skylift.utils.threads import OVERLAP_SWITCH_INTERVAL_S, switch_interval


def test_switch_interval_is_shortened_inside_and_restored_after() -> None:
    before = sys.getswitchinterval()
    assert before > OVERLAP_SWITCH_INTERVAL_S  # CPython's default is 5 ms
    with switch_interval() as inside:
        assert inside == pytest.approx(OVERLAP_SWITCH_INTERVAL_S, rel=0.05)
        assert sys.getswitchinterval() == pytest.approx(OVERLAP_SWITCH_INTERVAL_S, rel=0.05)
    assert sys.getswitchinterval() == before


def test_switch_interval_restored_after_an_error_and_a_shorter_one_kept() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.0001)
        with switch_interval(0.001) as inside:  # never lengthened
            assert inside == pytest.approx(0.0001, rel=0.05)
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(RuntimeError, match="boom"), switch_interval(0.002):
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="> 0 seconds"), switch_interval(0):
        pass
