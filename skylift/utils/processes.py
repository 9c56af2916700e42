"""Stopping child processes that lead their own process group (servers and their engines)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(process: subprocess.Popen, grace_s: float = 10.0, reap_s: float = 30.0) -> bool:
    """SIGTERM `process`, wait up to `grace_s`, then SIGKILL its whole process group (children it
    started, e.g. vLLM's engine core) and reap it. The process must have been started with
    `start_new_session=True`. Returns whether it was reaped within `reap_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=reap_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM raise `SystemExit(143)` in the main thread, so `finally` blocks run (a trainer
    shuts its engines down instead of leaving vLLM's engine processes orphaned)."""

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
