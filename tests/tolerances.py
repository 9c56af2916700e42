"""Tolerances derived from the computation (dtype, magnitudes, number of terms), not from one run.

Two paths that compute the same sum in another order (another batch shape or micro-batch split,
packing, prefix sharing, another SIMD width or thread count, another BLAS kernel) round
differently. Recursive summation of n terms x_i in a dtype with machine epsilon eps (unit
round-off u = eps / 2) errs by at most (n - 1) * u * sum|x_i| (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., section 4.2), for any order; blocked and pairwise orders do better.
That worst case needs every rounding error to point the same way. Rounding errors behave like
independent zero-mean variables, so the error grows like sqrt(n): Higham and Mary ("A New Approach
to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019) show that
|error| <= lam * sqrt(n) * u * sum|x_i| fails with probability at most about 2n * exp(-lam**2 / 2).
Two orders that each keep within that bound differ by at most lam * sqrt(n) * eps * sum|x_i|:
`sum_tolerance`, with lam = `LAMBDA`.

A wrong computation (a micro-batch dropped or counted twice, a token scored at the wrong
position) moves values by a sizeable fraction of their magnitude, many orders above this bound.
Paths that are bit-exact by design (copies, serialization, checkpoints) are compared with
`torch.equal`, not with these tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

# 2n * exp(-LAMBDA**2 / 2) is about 3e-8 * n: below 1e-4 for the n (a few thousand at most) here
LAMBDA = 6.0


def sum_tolerance(magnitude: float, n_terms: int, dtype: torch.dtype = torch.float32) -> float:
    """How far two float sums of the same `n_terms` terms may differ when added in another order.

    `magnitude` is sum|x_i| of the terms (or a bound on it); `dtype` the precision they are added
    in. Returns LAMBDA * sqrt(n_terms) * eps(dtype) * magnitude (see the module docstring)."""
    if n_terms < 1:
        raise ValueError(f"n_terms must be >= 1, got {n_terms}")
    if magnitude < 0:
        raise ValueError(f"magnitude must be >= 0, got {magnitude}")
    return LAMBDA * math.sqrt(n_terms) * torch.finfo(dtype).eps * magnitude


def assert_sums_close(
    got: torch.Tensor, want: torch.Tensor, n_terms: int, name: str = "", magnitude: float | None = None
) -> None:
    """`got` and `want` are the same sums of `n_terms` terms each, added in different orders.

    The scale of the terms (`magnitude`) defaults to the tensor's largest |value|: rounding errors
    enter every element through shared upstream values (activations, gradients flowing back) whose
    size is the tensor's, so an element that is small by cancellation still carries errors of that
    size and an elementwise relative tolerance would demand more than float arithmetic gives."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if magnitude is None:
        magnitude = max(float(want.abs().max()), float(got.abs().max())) if want.numel() else 0.0
    tol = sum_tolerance(magnitude, n_terms, want.dtype)
    worst = float((got - want).abs().max()) if want.numel() else 0.0
    assert worst <= tol, (
        f"{name}: max |difference| {worst:.3g} > tolerance {tol:.3g} "
        f"(n_terms={n_terms}, magnitude={magnitude:.3g}, dtype={want.dtype})"
    )


def assert_gradients_close(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], n_terms: int
) -> None:
    """Gradients of the same loss by parameter name, computed two ways; each sums `n_terms` terms
    (one per token).

    Each tensor is compared at the scale of its module's largest gradient: a bias sums the same
    per-token terms as its weight (times 1 instead of the module's input, whose entries are ~1 after
    normalisation), and can cancel to ~0 while its terms do not (a key projection's bias gets no
    gradient through the softmax)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    scale: dict[str, float] = {}
    for name, grad in want.items():
        module = name.rsplit(".", 1)[0]
        size = max(float(grad.abs().max()), float(got[name].abs().max())) if grad.numel() else 0.0
        scale[module] = max(scale.get(module, 0.0), size)
    for name, grad in want.items():
        assert_sums_close(got[name], grad, n_terms, name, magnitude=scale[name.rsplit(".", 1)[0]])
