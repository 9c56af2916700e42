"""`skylift train --dry-run` makes the routing-replay checks a run makes at its start
(`skylift.cluster.routing_run`): the same one-line refusal and exit code 2, reading the policy's
config only where it is on this machine, and a note where it is not."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen2Config, Qwen3MoeConfig

from skylift.cluster.routing_run import dry_run_routing_checks
from skylift.config import load_config
from skylift.entrypoints.main_base import RunOptions, prepare_run

ON = "generator.enable_return_routed_experts=true"
REMOTE = ["generator.run_engines_locally=false", "generator.remote_inference_engine_urls=['127.0.0.1:9']"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny mixture of experts (4 experts, top-2) and a dense model: config.json only."""
    root = tmp_path_factory.mktemp("configs")
    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16).save_pretrained(
        root / "moe"
    )
    Qwen2Config(**small).save_pretrained(root / "dense")
    return root / "moe", root / "dense"


def _dry_run(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    out = prepare_run("skylift", RunOptions(overrides=overrides, dry_run=True))
    assert isinstance(out, int)
    return out, capsys.readouterr().err


def test_a_dry_run_refuses_what_the_run_refuses_at_start(
    configs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    moe, dense = configs
    rc, err = _dry_run(capsys, ON, f"trainer.policy.model.path={dense}", *REMOTE)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"skylift: configuration error: {ON} but the policy {dense} is not a mixture-of-experts" in err
    rc, err = _dry_run(capsys, ON, f"trainer.policy.model.path={moe}")  # local engines capture on CPU too
    assert rc == 0 and "note:" not in err and "the configuration is valid" in err, err
    rc, err = _dry_run(
        capsys, ON, f"trainer.policy.model.path={moe}", *REMOTE, "generator.enable_prefix_caching=false"
    )
    assert rc == 2 and "needs generator.enable_prefix_caching=true" in err, err
    sp = "trainer.policy.sequence_parallel_size=2"
    rc, err = _dry_run(
        capsys,
        ON,
        f"trainer.policy.model.path={moe}",
        *REMOTE,
        sp,
        "trainer.placement.policy_num_gpus_per_node=2",
    )
    assert rc == 2 and "sequence_parallel_size must be 1" in err, err
    rc, err = _dry_run(capsys, ON, f"trainer.policy.model.path={moe}", *REMOTE)  # remote engines capture
    assert rc == 0 and "note:" not in err and "the configuration is valid" in err, err
    rc, err = _dry_run(capsys, f"trainer.policy.model.path={dense}")  # no routing replay: nothing checked
    assert rc == 0 and "note:" not in err, err


def test_a_model_the_dry_run_cannot_read_is_a_note_and_the_other_checks_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc, err = _dry_run(capsys, ON, "trainer.policy.model.path=/no/such/model", *REMOTE)
    assert rc == 0, err
    assert (
        "note: generator.enable_return_routed_experts: whether the policy is a mixture of experts was not checked"
        in err
    )
    assert "/no/such/model names no directory on this machine" in err
    rc, err = _dry_run(  # the checks that need no model still run
        capsys, ON, "trainer.policy.model.path=/no/such/model", "generator.enable_prefix_caching=false"
    )
    assert rc == 2 and "needs generator.enable_prefix_caching=true" in err, err
    # a Hub id nowhere in the local cache: nothing is downloaded
    cfg = load_config([ON, "trainer.policy.model.path=nobody-here/no-such-model", *REMOTE])
    (note,) = dry_run_routing_checks(cfg)
    assert "could not be read here without a download" in note
    # a built-in model not prepared yet is not built by a dry run
    monkeypatch.setenv("SKYLIFT_CACHE_DIR", str(tmp_path))
    (note,) = dry_run_routing_checks(load_config([ON, "trainer.policy.model.path=tiny-qwen3-moe", *REMOTE]))
    assert "tiny-qwen3-moe is not prepared here (skylift models prepare tiny-qwen3-moe)" in note
    assert not (tmp_path / "models" / "tiny-qwen3-moe").exists()
