"""The package layout rules: no import cycle, arrows only downward, no module over 500 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500
#: Modules being split by work in flight (issue 14, item 1: the trainer's loop, experience and
#: runtime). Each entry must still be too long; the list only shrinks.
ALLOWED_LONG: set[str] = set()


def test_import_graph_has_no_cycle_and_points_downward() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "inference" in result.stdout and "weight_sync" in result.stdout


def test_import_graph_reports_an_upward_arrow(tmp_path: Path) -> None:
    """The checker itself fails on a lower package importing a higher one (so the test above can fail)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    files = {"skylift/weight_sync/a.py": {"skylift/inference/b.py"}, "skylift/inference/b.py": set()}
    packages = import_graph.package_graph(files)
    assert packages == {"weight_sync": {"inference"}, "inference": set()}
    problems = import_graph.direction_problems(packages, files)
    assert problems == ["weight_sync -> inference points upward (in skylift/weight_sync/a.py)"]
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]


def test_no_module_over_500_lines() -> None:
    long = {}
    folders = ("skylift", "tests", "benchmarks", "scripts", "examples")  # tests are modules too
    for path in sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            long[str(path.relative_to(ROOT))] = lines
    assert not set(long) - ALLOWED_LONG, f"modules over {MAX_LINES} lines: {long}"
    assert not ALLOWED_LONG - set(long), (
        f"no longer too long, remove from ALLOWED_LONG: {ALLOWED_LONG - set(long)}"
    )


def test_receiver_serves_the_protocol_rpc_names() -> None:
    """Every RPC name of the weight-sync protocol is a method of the receiver vLLM mixes in."""
    from skylift.weight_sync import protocol
    from skylift.weight_sync.delta.receiver import DeltaReceiverExtension
    from skylift.weight_sync.worker_side import WorkerReceivers

    class WeightSyncWorkerExtension(DeltaReceiverExtension, WorkerReceivers):  # as vllm_worker's, less LoRA
        pass

    names = [getattr(protocol, n) for n in dir(protocol) if n.startswith("RPC_")]
    assert len(names) == 7  # init, receive, receive stream, destroy, has group, load delta, worker call
    for name in names:
        assert callable(getattr(WeightSyncWorkerExtension, name, None)), name


def test_test_module_basenames_are_unique() -> None:
    # pytest imports test modules by basename (rootdir-relative, no packages): two files with one
    # name in different test folders stop the whole run at collection
    names: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename: {clashes}"
