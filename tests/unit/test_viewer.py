"""`skylift view RUN_DIR`: the report's files from a run's records, the command, `--serve`."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest
from viewer_runs import write_run

from skylift.cli import main
from skylift.viewer import NoRecordsError, build_report
from skylift.viewer.serve import report_server


def _index(report: Path) -> dict:
    text = (report / "data" / "index.js").read_text()
    assert text.startswith("skyliftView.index(") and text.rstrip().endswith(");")
    return json.loads(text.strip()[len("skyliftView.index(") : -2])


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("tool_run"), "tools")


def test_the_report_lists_every_record_and_the_step_times(tool_run: Path) -> None:
    index_html = build_report(tool_run)
    assert index_html == tool_run / "viewer" / "index.html"
    report = index_html.parent
    assert sorted(p.name for p in report.iterdir()) == ["data", "index.html", "viewer.css", "viewer.js"]
    html = index_html.read_text()
    assert "http://" not in html and "https://" not in html  # nothing from the network
    index = _index(report)
    assert [e["step"] for e in index["train"]] == [1, 2] and [e["step"] for e in index["eval"]] == [1, 2]
    first = index["train"][0]
    assert first == {"name": "train_step_1", "step": 1, "groups": 3, "samples": 12, "reward_mean": 0.5}
    assert index["eval"][0]["k"] == 4 and index["eval"][0]["pass_at_k"] == 1.0
    assert index["eval"][0]["accuracy"] == 0.5
    times = index["timings"]
    assert [t["step"] for t in times] == [1, 2]
    assert times[0]["generate"] == 4.0 and times[0]["train"] == 4.5 and times[0]["records"] > 0
    record = (report / "data" / "train_step_1.js").read_text()
    assert record.startswith('skyliftView.add("train_step_1", {')


def test_the_command_prints_the_index_and_refuses_a_folder_without_records(
    tool_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["view", str(tool_run / "logs")]) == 0  # the log_dir itself works too
    assert capsys.readouterr().out.strip() == str(tool_run / "logs" / "viewer" / "index.html")
    assert main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"skylift view: {tmp_path} holds no run records: expected {tmp_path}/logs/rollouts")
    assert "\n" not in err and "Traceback" not in err
    assert main(["view", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(NoRecordsError):
        build_report(tmp_path)


def test_a_run_with_metrics_but_no_records_still_gets_its_step_times(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    rows = [{"step": 1, "timing/step_s": 2.0, "timing/generate_s": 1.5}, {"step": 1, "eval/accuracy": 0.5}]
    (tmp_path / "logs" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "ti'
    )
    index = _index(build_report(tmp_path).parent)
    assert index["train"] == [] and index["eval"] == []
    assert index["timings"] == [
        {"step": 1, "step_s": 2.0, "generate": 1.5, "wait": 0.0, "experience": 0.0, "train": 0.0, "sync": 0.0}
        | {"eval": 0.0, "records": 0.0}
    ]


def test_serve_answers_the_reports_files_on_loopback(tool_run: Path) -> None:
    report = build_report(tool_run).parent
    server = report_server(report, 0)
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=10) as answer:
            assert b"skylift view" in answer.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/train_step_2.js", timeout=10) as answer:
            assert answer.read().startswith(b'skyliftView.add("train_step_2"')
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_serve_on_a_taken_port_says_so(tool_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = report_server(tool_run, 0)
    try:
        port = taken.server_address[1]
        assert main(["view", str(tool_run), "--serve", "--port", str(port)]) == 2
    finally:
        taken.server_close()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"skylift view: cannot serve on 127.0.0.1:{port}: ") and "Traceback" not in err
