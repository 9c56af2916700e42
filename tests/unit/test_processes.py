"""skylift.utils.processes: SIGTERM runs clean-up; a server's process group is stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from skylift.utils.processes import stop_process_group

CHILD = """
import time
from skylift.utils.processes import exit_cleanly_on_sigterm
exit_cleanly_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("cleaned up", flush=True)
"""


def test_sigterm_runs_finally_blocks() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert "cleaned up" in out
    assert child.returncode == 128 + signal.SIGTERM


def test_stop_process_group_kills_what_the_child_started() -> None:
    # a shell that ignores SIGTERM and has a grandchild: both must be gone
    script = "trap '' TERM; sleep 60 & echo $!; wait"
    child = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    assert stop_process_group(child, grace_s=0.5)
    assert child.returncode is not None
    import psutil

    # SIGKILL is delivered asynchronously: within a few seconds (a loaded machine) the grandchild is
    # gone, or a zombie until its new parent reaps it
    deadline = time.monotonic() + 10.0
    status = "running"
    while time.monotonic() < deadline:
        try:
            status = psutil.Process(grandchild).status()
        except psutil.NoSuchProcess:
            status = "gone"
        if status in ("gone", psutil.STATUS_ZOMBIE):
            break
        time.sleep(0.05)
    assert status in ("gone", psutil.STATUS_ZOMBIE), f"grandchild {grandchild} still {status}"
