"""Engine failure mid-rollout (issue 8, item 2), with real `skylift serve` processes killed by
SIGKILL while they generate.

- A training run against two servers loses one during step 2: training goes on with the other
  (the weight-update group is rebuilt without the dead engine, so the survivor's logprobs still
  match the trainer's). Losing the last one stops training cleanly with a checkpoint of the last
  completed step; `resume_mode=latest` against a fresh server continues to the end.
- The pool's own failover (a dead engine's prompts answered by the other, `NoHealthyEngineError`
  naming every engine) is tested with fake engines in tests/unit/test_engine_pool.py.

Run inside a loopback-only namespace: bash scripts/loopback.sh .venv/bin/pytest tests/reliability
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from server_helpers import (
    ServerHandle,
    require_loopback_namespace,
    start_server,
    stop_server,
    tiny_server_args,
    wait_healthy,
)

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.envs import Environment, StepResult, register_env
from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.inference.types import EngineUnavailableError, SamplingParams
from skylift.rl import checkpoint as ckpt
from skylift.rl.build import build_trainer
from skylift.rl.loop import TrainingStoppedError

#: How long the killer waits for the engine to have work in flight before giving up.
KILL_WAIT_S = 120.0


@register_env("failover_even_length", override=True)
class EvenLengthEnv(Environment):
    """Reward 1 for an even-length response: random for the tiny model, so updates are non-zero."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


@pytest.fixture()
def servers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[[], ServerHandle]]:
    """Start tiny-model servers on demand (in parallel when started back to back); all stopped at the end."""
    require_loopback_namespace()
    started: list[ServerHandle] = []

    def start() -> ServerHandle:
        handle = start_server(tiny_model_dir, tmp_path / f"server-{len(started)}.log", tiny_server_args())
        started.append(handle)
        return handle

    yield start
    for handle in started:
        stop_server(handle, grace_s=10.0)


def _kill_hard(handle: ServerHandle) -> None:
    """SIGKILL the server and everything in its process group (vLLM's engine core too)."""
    os.killpg(handle.process.pid, signal.SIGKILL)
    handle.process.wait(timeout=30)


def _kill_when_busy(
    pool: Callable[[], EnginePool | None], index: int, handle: ServerHandle, when: Callable[[], bool]
) -> threading.Thread:
    """A thread that SIGKILLs `handle` as soon as `when()` holds and engine `index` has work in flight."""

    def run() -> None:
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            p = pool()
            if p is not None and when() and p.router.in_flight[index] > 0:
                _kill_hard(handle)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def even_length_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("failover-data")
    write_arithmetic_dataset(out, num_train=32, num_val=8, seed=0)
    for split in ("train", "validation"):
        table = pq.read_table(out / f"{split}.parquet")
        column = pa.array(["failover_even_length"] * table.num_rows)
        table = table.set_column(table.schema.get_field_index("env_class"), "env_class", column)
        pq.write_table(table, out / f"{split}.parquet")
    return out


def _overrides(data: Path, run_dir: Path, model: Path, urls: list[str], **extra: object) -> list[str]:
    base: dict[str, object] = {
        "trainer.policy.model.path": str(model),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": f"['{data / 'validation.parquet'}']",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": "["
        + ",".join(f"'{u.removeprefix('http://')}'" for u in urls)
        + "]",
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 64,
        "trainer.max_prompt_length": 128,
        "trainer.eval_interval": -1,
        "trainer.eval_before_train": False,
        "trainer.ckpt_interval": -1,  # only the stop after an engine loss writes a checkpoint
        "trainer.max_steps": 4,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.ckpt_path": str(run_dir / "ckpts"),
        "trainer.export_path": str(run_dir / "exports"),
        "trainer.log_dir": str(run_dir / "logs"),
        "trainer.logger": "['console']",
        "generator.http_timeout_s": 120,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_training_survives_one_engine_and_stops_cleanly_without_any(
    servers: Callable[[], ServerHandle], even_length_data: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    a, b = servers(), servers()
    wait_healthy(a)
    wait_healthy(b)
    trainer = build_trainer(
        load_config(_overrides(even_length_data, tmp_path, tiny_model_dir, [a.url, b.url])), console=False
    )
    try:
        trainer.setup()
        # engine 0 dies while step 2 generates; engine 1 dies while step 4 generates
        first = _kill_when_busy(lambda: trainer.parts.engines, 0, a, lambda: trainer.state.global_step == 1)
        second = _kill_when_busy(lambda: trainer.parts.engines, 1, b, lambda: trainer.state.global_step == 3)
        with pytest.raises(TrainingStoppedError) as info:
            trainer.fit()
        first.join(timeout=5)
        second.join(timeout=5)
    finally:
        trainer.shutdown()
    message = str(info.value)
    assert "during step 4" in message and "resume_mode=latest" in message, message
    assert a.url in message and b.url in message, message
    steps = [h for h in trainer.history if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    assert "engines/live" not in steps[0] and steps[1]["engines/live"] == 1 and steps[2]["engines/live"] == 1
    for row in steps:  # the survivor got every update: its logprobs match the trainer's
        assert row["policy/logprob_diff_vs_rollout"] < 1e-3, row
    assert ckpt.latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / "global_step_3"
    assert ckpt.load_trainer_state(tmp_path / "ckpts" / "global_step_3").policy_version == 3

    c = servers()
    wait_healthy(c)
    resumed = build_trainer(
        load_config(
            _overrides(
                even_length_data, tmp_path, tiny_model_dir, [c.url], **{"trainer.resume_mode": "latest"}
            )
        ),
        console=False,
    )
    try:
        resumed.setup()
        assert resumed.state.global_step == 3
        history = resumed.fit()
    finally:
        resumed.shutdown()
    rows = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in rows] == [4]
    assert rows[0]["policy/logprob_diff_vs_rollout"] < 1e-3  # the fresh engine got the resumed weights


#: Times the local engine-death test runs (a fresh engine each): the race it guards against showed
#: in about 1 of 13 kills; `SKYLIFT_ENGINE_DEATH_REPEATS=20` for the issue's loop.
ENGINE_DEATH_REPEATS = int(os.environ.get("SKYLIFT_ENGINE_DEATH_REPEATS", "1"))
#: The longest a call waiting on a killed engine may take to end (its timeout is 300 s).
ENGINE_DEATH_WAIT_S = 5.0


@pytest.mark.parametrize("attempt", range(ENGINE_DEATH_REPEATS))
def test_a_local_engine_whose_core_process_is_killed_ends_every_waiting_call_at_once(
    tiny_model_dir: Path, attempt: int
) -> None:
    """In-process engines (placement backend local): vLLM's engine core is a child process,
    killed (with its children) a random moment after generation started, while new calls keep
    arriving: a pool call and every direct call end within `ENGINE_DEATH_WAIT_S` of the kill,
    each naming the engine (issue 42, item 6: one call used to wait for its whole timeout)."""
    require_loopback_namespace()
    import random

    import psutil

    from skylift.inference.local import LocalVLLMEngine

    delay = random.Random(attempt).uniform(0.05, 0.6)  # how long after the first call the kill comes

    async def scenario() -> tuple[list[float], list[EngineUnavailableError | None]]:
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        engine = await LocalVLLMEngine.create(
            str(tiny_model_dir),
            name="doomed",
            enforce_eager=True,
            max_model_len=512,
            dtype="float32",
            generate_timeout_s=300.0,
        )
        try:
            spawned = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            assert spawned, "the engine started no child process"
            pool = EnginePool([engine])
            params = SamplingParams(max_tokens=500, ignore_eos=True, n=4)
            calls = [asyncio.create_task(pool.generate([[1, 2, 3]] * 4, params))]
            while pool.router.in_flight[0] == 0:
                await asyncio.sleep(0.001)
            kill_at = time.monotonic() + delay
            while time.monotonic() < kill_at:  # a new call every 20 ms up to the kill and after it
                calls.append(asyncio.create_task(engine.generate([[4, 5, 6]], params)))
                await asyncio.sleep(0.02)
            for p in spawned:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            killed_at = time.monotonic()
            for _ in range(10):
                calls.append(asyncio.create_task(engine.generate([[7, 8]], params)))
                await asyncio.sleep(0.02)
            ended: list[float] = []
            errors: list[EngineUnavailableError | None] = []
            for call in calls:
                try:
                    await asyncio.wait_for(call, 60)
                except EngineUnavailableError as exc:
                    errors.append(exc)
                else:
                    errors.append(None)  # finished before the kill: nothing to end
                ended.append(time.monotonic() - killed_at)
            return ended, errors
        finally:
            await engine.close()

    ended, errors = asyncio.run(scenario())
    failed = [str(e) for e in errors if e is not None]
    print(
        f"engine death (attempt {attempt}, kill {delay:.2f} s in): {len(failed)} of {len(ended)} calls "
        f"failed, the last ended {max(ended):.2f} s after the kill"
    )
    assert max(ended) < ENGINE_DEATH_WAIT_S, ended
    assert isinstance(errors[0], NoHealthyEngineError), errors[0]  # the pool's call: no engine left
    for message in failed:
        assert "doomed" in message and "the vLLM engine process died" in message, message
