"""The rule that picks a weight transport from where the ranks are (`weight_sync.topology`),
over fake topologies, and the one-line refusal of a forced backend that cannot work."""

from __future__ import annotations

import pytest

from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.topology import Place, check_forced, choose_transport, choose_transports

GPU0, GPU1, GPU2 = (Place("h1", "cuda", f"GPU-{i}") for i in range(3))
CPU_H1, CPU_H2 = Place("h1"), Place("h2")


def test_each_layout_gets_its_transport() -> None:
    assert choose_transport(GPU0, [GPU0]) == "ipc"  # same GPU: CUDA IPC, never NCCL
    assert choose_transport(GPU0, [GPU1]) == "nccl"  # another GPU
    assert choose_transport(GPU0, [Place("h2", "cuda", "GPU-0")]) == "nccl"  # same index, other host
    assert choose_transport(CPU_H1, [CPU_H1]) == "ipc"  # CPU, one host: shared memory
    assert choose_transport(CPU_H1, [CPU_H2]) == "gloo"  # CPU, another host
    assert choose_transport(GPU0, [CPU_H1]) == "ipc" and choose_transport(GPU0, [CPU_H2]) == "gloo"
    assert choose_transport(CPU_H1, [GPU1]) == "ipc"  # a CPU trainer's tensors in shared memory


def test_tensor_parallel_engines_and_several_engines() -> None:
    # TP=2 with one worker on the trainer's GPU: IPC for the whole engine (NCCL would refuse it)
    assert choose_transport(GPU0, [GPU0, GPU1]) == "ipc"
    assert choose_transport(GPU0, [GPU1, GPU2]) == "nccl"
    assert choose_transport(CPU_H1, [CPU_H1, CPU_H1]) == "ipc"
    assert choose_transport(CPU_H1, [CPU_H1, CPU_H2]) == "gloo"  # one worker elsewhere: the wire
    # several engines: each its own
    assert choose_transports(GPU0, [[GPU0], [GPU1], [Place("h2", "cuda", "GPU-9")]]) == [
        "ipc",
        "nccl",
        "nccl",
    ]
    with pytest.raises(WeightSyncError, match="place the engine's workers on one host"):
        choose_transport(GPU0, [GPU0, Place("h2", "cuda", "GPU-7")])
    with pytest.raises(ValueError, match="at least one worker"):
        choose_transport(GPU0, [])
    with pytest.raises(ValueError, match="names its GPU"):
        Place("h1", "cuda")


def test_a_forced_backend_that_cannot_work_is_refused_in_one_line() -> None:
    with pytest.raises(WeightSyncError) as refused:
        check_forced("nccl", GPU0, [[GPU1], [GPU1, GPU0]])
    message = str(refused.value)
    assert message == (
        "weight_sync_backend=nccl cannot work: the trainer's rank 0 and engine 1's worker 1 share GPU GPU-0 "
        'on h1, and NCCL 2.29 refuses two ranks on one GPU ("Duplicate GPU detected"); use '
        "weight_sync_backend=auto (CUDA IPC for a same-GPU engine) or ipc"
    )
    assert "\n" not in message
    with pytest.raises(
        WeightSyncError, match=r"^weight_sync_backend=nccl cannot work: the trainer's rank 0 runs on CPU"
    ):
        check_forced("nccl", CPU_H1, [[CPU_H1]])
    with pytest.raises(WeightSyncError, match="engine 0's worker 0 runs on h2, the trainer on h1"):
        check_forced("ipc", CPU_H1, [[CPU_H2]])
    # what can work passes
    check_forced("nccl", GPU0, [[GPU1, GPU2]])
    check_forced("gloo", GPU0, [[GPU0]])  # gloo copies through host memory: slow, but it works
    check_forced("ipc", GPU0, [[GPU0], [CPU_H1]])


def test_a_run_that_forces_nccl_onto_a_shared_gpu_is_refused_at_start() -> None:
    from skylift.config import load_config
    from skylift.weight_sync.factory import check_backend

    forced = ["generator.inference_engine.weight_sync_backend=nccl"]
    with pytest.raises(
        WeightSyncError,
        match=r"^weight_sync_backend=nccl cannot work: .*share GPU 0.*use weight_sync_backend=auto",
    ):
        check_backend(load_config([*forced, "trainer.placement.colocate_all=true"]), cuda=True)
    with pytest.raises(WeightSyncError, match="Duplicate GPU detected"):
        check_backend(load_config([*forced, "trainer.placement.backend=local"]), cuda=True)
    check_backend(
        load_config([*forced, "trainer.placement.colocate_all=true"]), cuda=False
    )  # CPU: nothing shared
    check_backend(load_config(forced), cuda=True)  # engines on their own GPUs
    check_backend(load_config(["trainer.placement.colocate_all=true"]), cuda=True)  # auto is not forced
    remote = [*forced, "trainer.placement.colocate_all=true", "generator.run_engines_locally=false"]
    check_backend(load_config(remote), cuda=True)  # the run starts no engine


def test_auto_takes_gloo_where_the_runs_engines_share_the_policys_gpu() -> None:
    from skylift.config import load_config
    from skylift.weight_sync.factory import group_backend

    shared = ["trainer.placement.colocate_all=true"]
    assert group_backend(load_config(shared), cuda=True) == "gloo"  # NCCL would refuse the pair
    assert group_backend(load_config(["trainer.placement.backend=local"]), cuda=True) == "gloo"
    assert group_backend(load_config(shared), cuda=False) is None  # CPU: auto (gloo) as before
    assert group_backend(load_config([]), cuda=True) is None  # engines on GPUs of their own: NCCL
    forced = ["generator.weight_sync_backend=gloo", *shared]
    assert group_backend(load_config(forced), cuda=True) == "gloo"


def test_shared_memory_must_hold_the_weights_with_room_to_spare() -> None:
    from skylift.weight_sync.topology import SHM_SPARE_BYTES, shared_memory_fits

    mib = 1 << 20
    assert shared_memory_fits(651 * mib, 24 << 30) == (True, "")
    assert shared_memory_fits(651 * mib, 651 * mib + SHM_SPARE_BYTES) == (True, "")
    fits, why = shared_memory_fits(651 * mib, 651 * mib + SHM_SPARE_BYTES - 1)
    assert not fits and why.startswith("/dev/shm has 907 MiB free, the weights need 651 MiB"), why
    assert shared_memory_fits(None, 24 << 30) == (False, "the weights' size is not known before gathering")
    assert shared_memory_fits(mib, None) == (False, "/dev/shm is not usable")


def test_network_namespaces_are_hosts_of_their_own() -> None:
    """The multihost tests' simulated hosts (one kernel, a network namespace each) and containers
    with networks of their own must not share memory: the host id names the namespace."""
    import os

    from skylift.weight_sync.ipc.place import host_id

    here = host_id()
    assert here.endswith(f"/{os.stat('/proc/self/ns/net').st_ino}"), here
