"""Both servers refuse to listen beyond loopback without a key unless told `--insecure`, and take
their key from a file or an environment variable (out of `ps`). No server is started."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from skylift.inference.server import prepare_args, read_key_file
from skylift.tinker.commands import API_KEY_ENV, add_tinker_command, api_key_from, check_exposure


def serve_args(**flags: object) -> argparse.Namespace:
    """`skylift serve`'s parsed flags as prepare_args reads them (vLLM's parser not needed)."""
    base = {
        "model_tag": None,
        "model": "org/m",  # a Hub id: a local path must exist (test_serve_refuses_a_missing_model_directory)
        "served_model_name": None,
        "tokenizer": None,
        "enable_sleep_mode": False,
        "api_key": None,
        "api_key_file": None,
        "insecure": False,
        "host": "127.0.0.1",
        "uds": None,
    }
    return argparse.Namespace(**{**base, **flags})


def test_serve_refuses_a_bind_beyond_loopback_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"refused: binding to '0\.0\.0\.0' without an API key.*--insecure"):
        prepare_args(serve_args(host="0.0.0.0"))
    with pytest.raises(ValueError, match="'0.0.0.0'"):
        prepare_args(serve_args(host=""))  # every interface
    assert prepare_args(serve_args(host="::1")).host == "::1"
    assert prepare_args(serve_args(host="0.0.0.0", api_key=["k"])).api_key == ["k"]
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert prepare_args(serve_args(host="0.0.0.0")).host == "0.0.0.0"


def test_serve_with_insecure_binds_and_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING, logger="skylift.inference.server"):
        prepare_args(serve_args(host="0.0.0.0", insecure=True))
    assert any(
        "without an API key" in r.getMessage() and "--insecure" in r.getMessage() for r in caplog.records
    )


def test_serve_reads_its_key_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    key = tmp_path / "key"
    key.write_text("s3cret\n# ignored\n")
    args = prepare_args(serve_args(host="0.0.0.0", api_key_file=str(key)))
    assert args.api_key == ["s3cret"]
    with pytest.raises(ValueError, match="not both"):
        prepare_args(serve_args(api_key=["k"], api_key_file=str(key)))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_key_file(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))


def tinker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tinker_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["tinker", "serve", "--base-model", "m", *argv])


def test_tinker_refuses_a_bind_beyond_loopback_without_a_key(caplog: pytest.LogCaptureFixture) -> None:
    args = tinker_args("--host", "0.0.0.0")
    with pytest.raises(SystemExit, match=r"refused: binding to '0\.0\.0\.0' without an API key.*--insecure"):
        check_exposure(args.host, None, None, args.insecure)
    with caplog.at_level(logging.WARNING, logger="skylift.tinker"):
        assert check_exposure("0.0.0.0", None, None, tinker_args("--insecure").insecure) is True
    assert any("without an API key" in r.getMessage() for r in caplog.records)
    assert check_exposure("0.0.0.0", "k", None, False) is False
    assert check_exposure("0.0.0.0", None, "keys.txt", False) is False
    assert check_exposure("127.0.0.1", None, None, False) is False


def test_tinker_takes_its_key_from_the_environment() -> None:
    env = {API_KEY_ENV: "from-env"}
    assert api_key_from(tinker_args(), env) == "from-env"
    assert api_key_from(tinker_args("--api-key", "flag"), env) == "flag"
    assert api_key_from(tinker_args("--api-keys-file", "users.txt"), env) is None
    assert api_key_from(tinker_args(), {}) is None


def test_serve_refuses_a_missing_model_directory() -> None:
    """A model written as a local path that names no directory is one line, not a Hub lookup."""
    with pytest.raises(ValueError, match="model '/no/such/model': no such directory on this machine"):
        prepare_args(serve_args(model="/no/such/model"))
