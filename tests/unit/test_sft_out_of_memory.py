"""`skylift sft` (every objective: sft, dpo, reward) out of memory: one line, exit code 5, and the
`SFTConfig` keys that lower memory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from skylift.cli import main
from skylift.config.sft import sft_keys
from skylift.supervised.commands import OUT_OF_MEMORY_ADVICE

#: a LoRA rank whose adapter matrices (rank x hidden floats) are far beyond any host's memory: the
#: allocator refuses the first at once (beyond even the address space)
HUGE_RANK = 2**40

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
PAIR = {"prompt": "hi", "chosen": " hello there", "rejected": " go away"}


@pytest.mark.parametrize("objective", ["sft", "dpo", "reward"])
def test_a_rank_that_cannot_allocate_is_one_line_and_exit_code_5(
    objective: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real allocation failure in the rank's set-up, through the command's entry point."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(CHAT if objective == "sft" else PAIR) + "\n")
    code = main(
        [
            "sft",
            f"objective={objective}",
            f"model.path={tiny_model_dir}",
            f"train_datasets=[{data}]",
            "batch_size=1",
            "num_steps=1",
            f"model.lora.rank={HUGE_RANK}",
            "placement.backend=local",
            f"runs_dir={tmp_path}",
        ]
    )
    # a progress bar another test in this process switched back on (transformers' own state) may
    # come first; from a shell the command prints the line alone
    raw = capsys.readouterr().err
    err = "".join(f"{line}\n" for line in raw.split("\n")[:-1] if "\r" not in line) + raw.split("\n")[-1]
    assert code == 5, err
    assert (
        err.startswith("skylift sft: out of memory: [enforce fail at alloc_cpu.cpp") and err.count("\n") == 1
    )
    assert "DefaultCPUAllocator: can't allocate memory: you tried to allocate" in err
    assert err.endswith(f". {OUT_OF_MEMORY_ADVICE}\n") and "Traceback" not in err


def test_the_advice_names_only_keys_of_the_sft_config() -> None:
    """Every ``key=`` and every key-shaped name in the advice is a leaf of `SFTConfig` (a renamed key
    fails here), and the keys that lower memory most are among them."""
    keys = sft_keys()
    dotted_or_underscored = r"(?<![\w.])([a-z][a-z0-9]*(?:[._][a-z0-9]+)+)"
    named = set(re.findall(dotted_or_underscored, OUT_OF_MEMORY_ADVICE))
    named |= set(re.findall(r"(?<![\w.])([a-z0-9_.]+)=", OUT_OF_MEMORY_ADVICE))
    assert named and not named - set(keys), sorted(named - set(keys))
    assert {
        "micro_train_batch_size_per_gpu",
        "max_tokens_per_microbatch",
        "gradient_checkpointing",
        "bf16",
        "max_length",
        "model.lora.rank",
        "placement.num_gpus_per_node",
        "fsdp_config.cpu_offload",
        "resume_from",
    } <= named, sorted(named)
