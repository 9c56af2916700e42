"""From a configuration to a trainer: the rollout source a run's settings ask for.

Where the loop's side of the configuration is read, with `skylift.rl.sampling` for how it samples
(the cluster's side is read in `skylift.cluster.settings`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from skylift.cluster.runtime import Runtime
from skylift.config.schema import SkyliftConfig
from skylift.rl.console import Console
from skylift.rl.loop import RLTrainer
from skylift.rl.parts import Parts
from skylift.rl.rows import StepRows
from skylift.rl.sampling import Sampler, samplers
from skylift.rl.sources import (
    DynamicSampling,
    FullyAsyncSource,
    OneStepOffSource,
    RolloutSource,
    SyncSource,
)
from skylift.rl.step_wise import check_step_wise


def make_source(
    cfg: SkyliftConfig, parts: Parts, sampler: Sampler, total_steps: int, say: Callable[[str], None]
) -> RolloutSource:
    """The schedule `trainer.async_training` / `trainer.fully_async` ask for, with dynamic
    sampling around it when `trainer.algorithm.dynamic_sampling.type` is set."""
    t = cfg.trainer
    ds = t.algorithm.dynamic_sampling
    per_round = t.train_batch_size if ds.gen_batch_size == -1 else ds.gen_batch_size
    rows = StepRows(
        parts.train_data,
        t.train_batch_size,
        t.seed,
        shuffle=cfg.data.shuffle,
        epochs=t.epochs,
        oversample=per_round - t.train_batch_size if ds.type is not None else 0,
    )
    source: RolloutSource
    if t.fully_async.enabled:
        source = FullyAsyncSource(
            rows,
            sampler,
            label_engines=parts.weights.label,
            total_steps=total_steps,
            max_staleness=t.fully_async.max_staleness_steps,
            workers=t.fully_async.num_parallel_generation_workers or t.train_batch_size,
            timeout_s=cfg.generator.http_timeout_s,
            zero_variance_tol=t.algorithm.zero_variance_filter_tol
            if t.fully_async.sample_full_batch
            else None,
        )
    elif t.async_training:
        source = OneStepOffSource(rows, sampler, total_steps, t.max_staleness_steps)
    else:
        source = SyncSource(rows, sampler)
    if ds.type is None:
        return source
    return DynamicSampling(
        source,
        rows,
        sampler,
        mode=ds.type,
        batch_size=t.train_batch_size,
        per_round=per_round,
        max_rounds=None if ds.max_sample_batches == -1 else ds.max_sample_batches,
        min_replace_ratio=ds.min_replace_ratio,
        seed=t.seed,
        say=say,
    )


def parts_of(runtime: Runtime) -> Parts:
    """The loop's view of a started runtime."""
    assert runtime.policy is not None and runtime.weights is not None and runtime.train_data is not None
    assert runtime.generator is not None
    return Parts(
        train_data=runtime.train_data,
        val_data=runtime.val_data,
        generator=runtime.generator,
        loop=runtime.loop,
        policy=runtime.policy,
        weights=runtime.weights,
        tracking=runtime.tracking,
        ckpt_dir=runtime.paths.ckpt,
        export_dir=runtime.paths.export,
        logs_dir=runtime.paths.logs,
        pad_id=runtime.pad_id,
        ref=runtime.ref,
        critic=runtime.critic,
        engines=runtime.engines,
        sleep_engines=runtime.colocation.sleep_engines,
        decode=runtime.tokenizer.decode,
    )


def build_trainer(cfg: SkyliftConfig, *, console: bool = True, verbose: bool = False) -> RLTrainer:
    """Start the run's parts (`skylift.cluster.runtime.Runtime`: Ray, engines, workers) and a
    trainer over them; its `shutdown()` takes them down. A failed start takes down what was built.
    `console`: print progress; `verbose`: the libraries' own messages too."""
    return build_run(cfg, console=console, verbose=verbose)[1]


def build_run(
    cfg: SkyliftConfig, *, console: bool = True, verbose: bool = False
) -> tuple[Runtime, RLTrainer]:
    """`build_trainer`, and the runtime behind it for tools that look at processes (benchmarks)."""
    started = time.perf_counter()
    g = cfg.generator
    if g.step_wise_trajectories or g.on_template_mismatch == "step_wise":  # the estimator must fit
        a = cfg.trainer.algorithm
        check_step_wise(a.advantage_estimator, a.use_kl_in_reward)
    out = Console(console)
    runtime = Runtime(cfg, out.say, verbose)
    try:
        runtime.start()
        parts = parts_of(runtime)
        train, evaluation = samplers(cfg, parts)
        total = runtime.total_steps()
        source = make_source(cfg, parts, train, total, out.say)
        trainer = RLTrainer(cfg, parts, source, evaluation, total, out)
    except BaseException:
        runtime.close()
        raise
    trainer.close_parts = runtime.close
    trainer.started_at = started
    return runtime, trainer
