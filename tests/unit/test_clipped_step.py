"""`clipped_step`: a fused AdamW that takes the clip factor into its kernel steps as clipping the
gradients first does; a non-finite norm skips the step."""

from __future__ import annotations

import math

import pytest
import torch

from skylift.worker.optim import clipped_step


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (11,), (3, 3))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6, math.inf], ids=["clipped", "under", "no-clip"])
def test_fused_step_equals_clipping_first(max_norm: float) -> None:
    ours, theirs, unclipped = _params(), _params(), _params()
    fused = torch.optim.AdamW(ours, lr=0.1, fused=True)
    plain = torch.optim.AdamW(theirs, lr=0.1, foreach=False)
    free = torch.optim.AdamW(unclipped, lr=0.1, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # several steps: the moments carry the clipped gradients
        for p, q, r in zip(ours, theirs, unclipped, strict=True):
            p.grad = torch.randn(p.shape, generator=gen) * 3
            q.grad, r.grad = p.grad.clone(), p.grad.clone()
        norm = clipped_step(fused, ours, max_norm)
        want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        plain.step()
        free.step()
        assert float(norm) == pytest.approx(float(want), rel=1e-6)
        assert not hasattr(fused, "grad_scale")
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)
    # the clip did something where the norm was over max_norm
    moved = max(float((p - r).detach().abs().max()) for p, r in zip(ours, unclipped, strict=True))
    assert (moved > 1e-3) == (max_norm == 0.5)


def test_a_non_finite_norm_skips_the_step() -> None:
    params = _params()
    params[1].grad[0] = float("nan")
    before = [p.detach().clone() for p in params]
    for kernel in ({"fused": True}, {"foreach": False}):
        norm = clipped_step(torch.optim.AdamW(params, lr=0.1, **kernel), params, 1.0)
        assert not math.isfinite(float(norm))
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
