"""Run a test's rank script as 2 gloo processes on this machine (file:// rendezvous, loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def run_two_ranks(script: str, rdzv: str, args: Sequence[str], timeout_s: float = 300.0) -> None:
    """`python -c script RANK RDZV *args` for ranks 0 and 1; fails with both ranks' stderr tails."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), rdzv, *args], env=env, stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    errors = [p.communicate(timeout=timeout_s)[1] for p in ranks]
    assert all(p.returncode == 0 for p in ranks), "\n".join(e[-3000:] for e in errors)
