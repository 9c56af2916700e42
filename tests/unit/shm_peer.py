"""The two processes of `test_ipc_handles.test_a_receiver_outlives_the_senders_shm_manager`:
``python shm_peer.py sender`` shares tensors and prints the handle's wire form, then waits;
``python shm_peer.py receiver`` starts a sender, opens its handle, kills it (as Ray kills a policy
rank at a run's end) and reports, as one JSON line, whether the sender's ``torch_shm_manager``
outlived it (the receiver kept it alive) and whether the receiver survives dropping its views once
that manager is gone (torch's own opening aborted the receiver: "Broken pipe")."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time

import torch

from skylift.weight_sync.ipc.handles import handle_from_wire, handle_to_wire, open_shared, share_tensors


def _listener_of(path: str) -> list[int]:
    """The processes holding the listening unix socket bound to `path` (the manager's)."""
    with open("/proc/net/unix") as f:
        inodes = {line.split()[6] for line in f.read().splitlines()[1:] if line.endswith(" " + path)}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            links = {os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


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
    socket_path = bytes.fromhex(wire["buffers"][0]["args"][0]["hex"]).decode()
    managers = [pid for pid in _listener_of(socket_path) if pid != peer.pid]
    peer.kill()  # the sender dies; its manager should follow within ~2 s (no client left)
    peer.wait(timeout=10)
    deadline = time.monotonic() + 6.0
    while any(_alive(m) for m in managers) and time.monotonic() < deadline:
        time.sleep(0.1)
    outlived = [m for m in managers if _alive(m)]
    for m in outlived:  # as Ray does to a dead rank's children: the receiver now holds a dead socket
        os.kill(m, signal.SIGKILL)
    time.sleep(0.5)
    report = {
        "managers": len(managers),
        "manager_outlived_sender": bool(outlived),
        "read_after_sender_died": [float(views["w"].sum()), views["ids"].tolist()],
    }
    del views
    gc.collect()
    report["survived_dropping_views"] = True
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    {"sender": sender, "receiver": receiver}[sys.argv[1]]()
