"""`skylift demo`'s settings form a valid configuration."""

from __future__ import annotations

import pytest

from skylift.config import load_config
from skylift.demo import DEMO_OVERRIDES, demo_overrides, has_fast_bf16


def test_demo_overrides_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = load_config(demo_overrides(fast_bf16=True))
    assert cfg.trainer.policy.model.path == "smollm2-135m-instruct"
    assert cfg.generator.kv_cache_gb == 0.4
    assert cfg.trainer.policy.optimizer_config.scheduler == "linear"
    assert cfg.generator.model_dtype == "bfloat16" and cfg.trainer.bf16
    assert cfg.trainer.algorithm.dynamic_sampling.type == "filter"
    assert cfg.trainer.algorithm.dynamic_sampling.max_sample_batches == 1
    assert cfg.trainer.algorithm.dynamic_sampling.gen_batch_size == 16
    assert cfg.generator.max_generate_length == 40  # rollouts; evaluation answers in up to 64
    assert cfg.generator.eval_sampling_params.max_generate_length == 64
    assert cfg.generator.kv_cache_block_size == 32
    cfg = load_config(demo_overrides(fast_bf16=False))
    assert cfg.generator.model_dtype == "float32" and not cfg.trainer.bf16


def test_benchmarks_can_leave_out_dynamic_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """One plain GRPO step (grpo_step_vs_trl) and fully async (which refuses dynamic sampling)
    take the demo's settings without it; everything else stays."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    full = demo_overrides(fast_bf16=False)
    plain = demo_overrides(fast_bf16=False, dynamic_sampling=False)
    assert [o for o in full if "dynamic_sampling" not in o] == plain
    assert load_config(plain).trainer.algorithm.dynamic_sampling.type is None
    fully_async = load_config(
        [
            *plain,
            "trainer.fully_async.enabled=true",
            "trainer.algorithm.use_tis=true",
            "trainer.algorithm.tis_imp_ratio_cap=2.0",
        ]
    )
    assert fully_async.trainer.fully_async.enabled


X86_FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep avx2 avx512f avx512bw"


@pytest.mark.parametrize(
    ("cpuinfo", "fast"),
    [
        (f"processor\t: 0\nflags\t\t: {X86_FLAGS} avx512_bf16 avx512_vnni\n", True),  # Zen 4, Cooper Lake
        (f"processor\t: 0\nflags\t\t: {X86_FLAGS} amx_bf16 amx_tile\n", True),  # Sapphire Rapids
        (f"processor\t: 0\nflags\t\t: {X86_FLAGS}\n", False),  # AVX512 without BF16
        ("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n", False),  # AVX2 laptop
        ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),  # Arm Neoverse V1
        ("processor\t: 0\nFeatures\t: fp asimd evtstrm\n", False),
        ("", False),
    ],
)
def test_bf16_only_where_the_cpu_has_bf16_matrix_instructions(cpuinfo: str, fast: bool) -> None:
    assert has_fast_bf16(cpuinfo) is fast


def test_user_kv_cache_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM would refuse two KV cache sizes; the demo leaves it to the user's variable."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    overrides = demo_overrides(fast_bf16=False)
    assert not any(o.startswith("generator.kv_cache_gb=") for o in overrides)
    assert len(overrides) == len(DEMO_OVERRIDES) - 1
    assert load_config(overrides).generator.kv_cache_gb is None


def test_a_bad_override_is_a_clear_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from skylift.demo import run_demo

    assert run_demo(["trainer.max_steps=0"]) == 2
    err = capsys.readouterr().err
    assert "skylift demo: configuration error" in err and "trainer.max_steps=0 must be >= 1" in err
    assert "Traceback" not in err


def test_the_tools_task_adds_a_multi_turn_run_on_top(monkeypatch: pytest.MonkeyPatch) -> None:
    """`skylift demo --task tools`: the demo's settings, multi-turn with 3 turns, its own run name."""
    from skylift.demo import TOOL_TASK_OVERRIDES

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    overrides = demo_overrides(fast_bf16=False, task="tools")
    assert overrides[: len(DEMO_OVERRIDES)] == DEMO_OVERRIDES
    assert overrides[len(DEMO_OVERRIDES) :] == TOOL_TASK_OVERRIDES
    cfg = load_config(overrides)
    assert cfg.trainer.run_name == "demo-tools"
    assert cfg.generator.max_turns == 3 and not cfg.generator.batched
    assert cfg.generator.kv_cache_gb == 0.6 and cfg.trainer.max_prompt_length == 320
    assert cfg.trainer.algorithm.dynamic_sampling.type == "filter"
    with pytest.raises(ValueError, match="unknown demo task 'chess'"):
        demo_overrides(task="chess")


def test_the_demo_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from skylift.demo import run_demo

    assert run_demo([], worked_example="none") == 2  # only with --task tools
    assert "--worked-example / --no-worked-example go with --task tools" in capsys.readouterr().err
    from skylift.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--task", "chess"])
    assert "invalid choice: 'chess'" in capsys.readouterr().err


def test_the_tool_demo_worked_example_options() -> None:
    import argparse

    from skylift.demo import TOOL_DEMO_WORKED_EXAMPLE, add_demo_arguments

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    assert parser.parse_args(["--task", "tools"]).worked_example is None  # the demo's default
    assert parser.parse_args(["--worked-example", "sum"]).worked_example == "sum"
    assert parser.parse_args(["--no-worked-example"]).worked_example == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--worked-example", "division"])
    assert TOOL_DEMO_WORKED_EXAMPLE in ("product", "sum")
