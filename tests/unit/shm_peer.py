"""The two processes of `test_ipc_handles.test_a_receiver_outlives_a_killed_sender`:
``python shm_peer.py sender`` shares tensors and prints the handle's wire form, then waits;
``python shm_peer.py receiver`` starts a sender, opens its handle, kills it outright (as Ray kills a
policy rank at a run's end) and reports, as one JSON line, what the receiver still reads, whether
the sender had started any helper process (torch's sharing starts a ``torch_shm_manager``), whether
the dead sender's segment file was left and then swept, and whether the receiver survives
dropping its views."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys

import torch

from skylift.weight_sync.ipc.handles import handle_from_wire, handle_to_wire, open_shared, share_tensors
from skylift.weight_sync.ipc.shm_segments import SHM_DIR, sweep_stale


def _children_of(pid: int) -> list[str]:
    """The command names of `pid`'s child processes."""
    names = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(rest[1]) == pid:
            names.append(comm)
    return names


def sender() -> None:
    handle = share_tensors({"w": torch.arange(1000, dtype=torch.float32), "ids": torch.arange(7)})
    print(json.dumps(handle_to_wire(handle)), flush=True)
    sys.stdin.readline()


def receiver() -> None:
    peer = subprocess.Popen(
        [sys.executable, __file__, "sender"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    wire = json.loads(peer.stdout.readline())  # type: ignore[union-attr]
    views = open_shared(handle_from_wire(wire))
    segments = {b["args"][0] for b in wire["buffers"]}
    helpers = _children_of(peer.pid)
    os.kill(peer.pid, signal.SIGKILL)  # no finalizer runs: the sender's files stay behind
    peer.wait(timeout=10)
    left = sorted(s for s in segments if os.path.exists(os.path.join(SHM_DIR, s)))
    swept = sweep_stale()
    report = {
        "segments": len(segments),
        "sender_helpers": helpers,
        "read_after_sender_died": [float(views["w"].sum()), views["ids"].tolist()],
        "left_by_killed_sender": len(left),
        "swept": sorted(set(swept) & segments) == sorted(segments),
        "gone_after_sweep": not any(os.path.exists(os.path.join(SHM_DIR, s)) for s in segments),
    }
    report["read_after_sweep"] = float(views["w"].sum())
    del views
    gc.collect()
    report["survived_dropping_views"] = True
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    {"sender": sender, "receiver": receiver}[sys.argv[1]]()
