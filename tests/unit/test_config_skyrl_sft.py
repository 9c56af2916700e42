"""SkyRL's SFT example commands (``examples/train/sft``, ``skyrl.train.main_sft``) on `skylift sft`.

The fixture ``tests/unit/data/skyrl_sft_commands_head.txt`` holds the overrides of every command of
SkyRL's head (a956457) as ``scripts/skyrl_example_overrides.py`` extracts them. Every FSDP command
loads (its Hub datasets are read when a run starts, never by the dry run); every Megatron command
is refused with the one message naming Megatron.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from skylift.cli import main
from skylift.config.errors import ConfigError
from skylift.config.sft import load_sft_config

FIXTURE = Path(__file__).parent / "data" / "skyrl_sft_commands_head.txt"
MEGATRON = "skylift has no Megatron backend"


def commands() -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("# "):
            out.append((line[2:].split(" ", 1)[0], []))
        elif line:
            out[-1][1].append(line)
    return out


def test_every_fsdp_sft_command_loads_and_every_megatron_one_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logging.getLogger("skylift.config").setLevel(logging.ERROR)
    accepted, refused, wrong = [], [], []
    for source, overrides in commands():
        megatron = any(o.startswith(("strategy=megatron", "megatron_config.")) for o in overrides)
        try:
            load_sft_config(overrides)
            error = None
        except ConfigError as exc:
            error = str(exc)
        if megatron:
            (refused if error is not None and error.startswith(MEGATRON) else wrong).append(source)
        else:
            (accepted if error is None else wrong).append(f"{source}: {error}" if error else source)
    logging.getLogger("skylift.config").setLevel(logging.NOTSET)
    assert not wrong, wrong
    assert len(accepted) == 3 and len(refused) == 7
    print(
        f"SkyRL head's SFT examples: {len(accepted)} of {len(accepted)} FSDP commands accepted, {len(refused)} Megatron refused"
    )
    fsdp = dict(commands())["examples/train/sft/run_sft_fsdp.sh:1"]
    assert main(["sft", "--dry-run", *fsdp]) == 0
    out = capsys.readouterr().out
    assert "yahma/alpaca-cleaned" in out and "configuration OK" in out
    megatron = dict(commands())["examples/train/sft/run_sft_megatron.sh:1"]
    assert main(["sft", "--dry-run", *megatron]) == 2
    assert MEGATRON in capsys.readouterr().err
