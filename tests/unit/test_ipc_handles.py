"""`weight_sync.ipc.handles`: named tensors shared by handle with another process on this host
(CPU: torch's file_system shared memory; the CUDA path is the same code with CUDA IPC handles)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skylift.weight_sync.ipc.handles import handle_from_wire, handle_to_wire, open_shared, share_tensors


def named() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "ids": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(7, generator=g).to(torch.bfloat16),
        "b": torch.randn(2, generator=g),
        "empty": torch.zeros(0, 3),
    }


def test_a_handle_opens_the_same_tensors_in_the_order_given_and_not_by_copy() -> None:
    tensors = named()
    handle = share_tensors(tensors)
    assert handle.names == list(tensors) and handle.nbytes == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert len(handle.buffers) == 3  # one per dtype
    opened = open_shared(pickle.loads(pickle.dumps(handle)))
    assert list(opened) == list(tensors)
    assert all(torch.equal(opened[k], v) and opened[k].dtype == v.dtype for k, v in tensors.items())
    opened["w"][0, 0] = 123.0  # the same memory as the sender's buffer, not a copy
    assert open_shared(handle)["w"][0, 0].item() == 123.0
    assert tensors["w"][0, 0].item() != 123.0  # the sender's own tensors are untouched
    handle.release()


def test_the_wire_form_is_json_and_names_only_known_functions() -> None:
    tensors = named()
    handle = share_tensors(tensors)
    wire = json.loads(json.dumps(handle_to_wire(handle)))
    opened = open_shared(handle_from_wire(wire))
    assert all(torch.equal(opened[k], v) for k, v in tensors.items())
    wire["buffers"][0]["rebuild"] = "os.system"
    with pytest.raises(KeyError):
        handle_from_wire(wire)
    wire["buffers"][0]["rebuild"] = "open_cpu_storage"
    wire["buffers"][0]["dtype"] = "Tensor"
    with pytest.raises(ValueError, match="no torch dtype"):
        handle_from_wire(wire)


def test_another_process_reads_the_shared_tensors(tmp_path: Path) -> None:
    tensors = named()
    handle = share_tensors(tensors)
    code = (
        "import json, sys, torch\n"
        "from skylift.weight_sync.ipc.handles import handle_from_wire, open_shared\n"
        "got = open_shared(handle_from_wire(json.loads(sys.stdin.read())))\n"
        "torch.save({k: v.clone() for k, v in got.items()}, sys.argv[1])\n"
    )
    out = tmp_path / "got.pt"
    subprocess.run(
        [sys.executable, "-c", code, str(out)],
        input=json.dumps(handle_to_wire(handle)),
        text=True,
        check=True,
    )
    got = torch.load(out)
    assert list(got) == list(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())


def test_a_tensor_on_a_device_without_handles_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be shared by handle"):
        share_tensors({"m": torch.empty(2, device="meta")})


def test_a_handle_of_the_same_layout_is_refilled_in_place() -> None:
    tensors = named()
    handle = share_tensors(tensors)
    opened = open_shared(handle)  # a receiver that keeps its views open
    changed = {k: v + 1 if v.is_floating_point() else v * 2 for k, v in tensors.items()}
    assert share_tensors(changed, reuse=handle) is handle  # the same buffers, the same handles
    assert all(torch.equal(opened[k], v) for k, v in changed.items())  # seen without opening again
    other = {**changed, "w": torch.zeros(4, 3)}  # another shape: new buffers
    fresh = share_tensors(other, reuse=handle)
    assert fresh is not handle and torch.equal(open_shared(fresh)["w"], torch.zeros(4, 3))
    assert torch.equal(opened["w"], changed["w"])  # the old buffers untouched
    handle.release()
    fresh.release()


def test_a_receiver_outlives_a_killed_sender() -> None:
    """A long-lived engine loads from a sender that is then killed outright: the receiver still
    reads what it mapped and survives dropping it; the sender started no helper process (torch's
    sharing starts a ``torch_shm_manager``, whose death broke a later push or unmap: session 22's
    dead server, session 23's "Connection reset by peer"); the dead sender's file is left, then
    swept by the next sweep on the host."""
    peer = Path(__file__).with_name("shm_peer.py")
    done = subprocess.run([sys.executable, str(peer), "receiver"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["segments"] == 2  # one buffer per dtype: float32 and int64
    assert report["sender_helpers"] == []
    assert report["read_after_sender_died"] == [499500.0, list(range(7))]
    assert report["left_by_killed_sender"] == 2
    assert report["swept"] and report["gone_after_sweep"]
    assert report["read_after_sweep"] == 499500.0
    assert report["survived_dropping_views"]


def test_a_released_handle_unlinks_its_segments() -> None:
    import gc
    import os

    from skylift.weight_sync.ipc.shm_segments import SHM_DIR

    handle = share_tensors({"w": torch.ones(8)})
    path = os.path.join(SHM_DIR, handle.buffers[0].args[0])
    assert os.path.exists(path)
    opened = open_shared(handle)
    handle.release()
    gc.collect()
    assert not os.path.exists(path)
    assert float(opened["w"].sum()) == 8.0  # a mapping outlives the file


def test_a_segment_name_that_is_not_skylifts_is_refused() -> None:
    from skylift.weight_sync.ipc.shm_segments import open_segment

    with pytest.raises(ValueError, match="not a skylift shared-memory segment name"):
        open_segment("../etc/passwd", 8)


def test_buffers_that_dev_shm_cannot_hold_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's /dev/shm is 64 MB unless told otherwise; writing past a full tmpfs would kill
    the sender with SIGBUS, so the buffers are refused before anything is written."""
    import os

    class Full:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    with pytest.raises(RuntimeError, match=r"^shared tensors: 1 MiB do not fit in /dev/shm \(0 MiB free\)"):
        share_tensors({"w": torch.zeros(256, 1024)})
    assert share_tensors({"w": torch.ones(8)}).nbytes == 32  # what fits is shared
