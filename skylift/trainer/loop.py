"""The RL loop (GRPO and friends), read top to bottom.

One step: rollout (sample `n_samples_per_prompt` responses per prompt, the environments score
them) -> experience (reference logprobs, values, advantages: `experience.py`) -> update (policy and
critic mini-batches: `update.py`) -> sync (weights to the engines: `engine_weights.py`) -> eval ->
checkpoint. The parts a run is made of (Ray, engines, workers) come from `runtime.py`; the loop
does not know the algorithm: advantages, losses and reductions are looked up by name in
`skylift.algorithms`.

With `trainer.async_training=true` the generation of step t+1 overlaps the training of step t
(one-step-off; design and off-policy correction in `skylift.trainer.async_rollouts`). With
`trainer.fully_async.enabled=true` generation never stops: it streams into a bounded buffer and
every weight sync pauses the engines with requests in flight (`skylift.trainer.fully_async`).
Both run the rollouts on a thread beside training, so the GIL changes hands more often while they
do (`skylift.utils.threads`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from skylift.algorithms import make_kl_controller
from skylift.algorithms.sample_support import TokenDistribution, as_distribution
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.inference.types import EngineUnavailableError
from skylift.trainer import checkpoint as ckpt
from skylift.trainer.async_rollouts import BackgroundRollouts, with_next
from skylift.trainer.console import Console
from skylift.trainer.dynamic_sampling import dynamic_sample, step_rows
from skylift.trainer.engine_weights import EngineWeights
from skylift.trainer.evaluation import dump_eval, evaluate
from skylift.trainer.experience import ExperienceSettings, make_experience
from skylift.trainer.fully_async import FullyAsyncRollouts, LoopThread, PromptSource, rows_of
from skylift.trainer.runtime import Runtime
from skylift.trainer.sampling import rollout_seeds, sampling_params
from skylift.trainer.update import UpdateSettings, policy_objective, train_critic, train_policy
from skylift.trainer.workers import WorkerGroup
from skylift.utils.threads import switch_interval


class TrainingStoppedError(RuntimeError):
    """Training cannot go on (e.g. every inference engine failed); what could be saved was saved
    and the message says how to continue."""


class RLTrainer:
    """A run from a `SkyliftConfig`: `setup()` builds it, `fit()` trains, `shutdown()` ends it."""

    def __init__(self, cfg: SkyliftConfig, *, console: bool = True, verbose: bool = False) -> None:
        """`console`: print progress; `verbose`: also the libraries' own messages."""
        self.cfg = cfg
        self.console = Console(console)
        self.runtime = Runtime(cfg, self.console.say, verbose)
        self.state = ckpt.TrainerState()
        self.history: list[dict[str, float]] = []
        self.weights: EngineWeights | None = None
        self.rollouts: BackgroundRollouts[list[Trajectory]] | None = None  # async_training only
        kl = cfg.trainer.algorithm.kl_ctrl  # the KL-in-reward coefficient, adapted per step or fixed
        self.kl_ctrl = make_kl_controller(
            kl.type, cfg.trainer.algorithm.kl_loss_coef, kl.kl_target, kl.horizon
        )

    def setup(self) -> None:
        started = time.perf_counter()
        rt = self.runtime
        rt.start()
        assert rt.policy is not None and rt.engines is not None
        self.weights = EngineWeights(
            self.cfg, rt.policy, rt.engines, rt.engine_refs, rt.run, self.console.say
        )
        self.weights.open()
        if not self._maybe_resume() and not self.cfg.generator.run_engines_locally:
            # a server may still hold another run's weights: start from this run's
            self.weights.sync(self.state.policy_version)
        self.experience_settings = ExperienceSettings.from_config(self.cfg, rt.pad_id)
        self.update_settings = UpdateSettings.from_config(self.cfg)
        self.objective = policy_objective(self.cfg)
        self.console.say(f"set-up done in {time.perf_counter() - started:.1f} s")

    # ================================================================== the loop
    def fit(self) -> list[dict[str, float]]:
        t, rt = self.cfg.trainer, self.runtime
        total_steps = rt.total_steps()
        if t.eval_before_train and self.state.global_step == 0:
            metrics = self.evaluate()
            if metrics:
                self._log(metrics)
                self.console.say(f"step 0 | eval accuracy {metrics['eval/accuracy']:.3f}")
        start_epoch, start_step = rt.train_data.locate(self.state.global_step, t.train_batch_size)
        batches = rt.train_data.iter_training(
            t.train_batch_size,
            t.seed,
            t.epochs,
            start_epoch=start_epoch,
            start_step=start_step,
            shuffle=self.cfg.data.shuffle,
        )
        self.console.start_progress(total_steps, self.state.global_step)
        if t.async_training:
            self.rollouts = BackgroundRollouts(rt.loop)
        overlapped = t.async_training or t.fully_async.enabled  # rollouts on a thread beside training
        try:
            with switch_interval() if overlapped else contextlib.nullcontext():
                self._fit_steps(batches, total_steps)
        except EngineUnavailableError as exc:
            raise self._stop_after_engine_loss(exc) from exc
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
                self.rollouts = None
            self.console.close_progress()
        return self.history

    def _fit_steps(self, batches: Iterator[tuple[int, int, list[PromptSample]]], total_steps: int) -> None:
        t = self.cfg.trainer
        if t.fully_async.enabled:
            self._fit_fully_async(batches, total_steps)
            return
        for (epoch, step_in_epoch, rows), upcoming in with_next(batches):
            if self.state.global_step >= total_steps:
                break
            tick = time.perf_counter()
            if t.async_training:
                last = upcoming is None or self.state.global_step + 1 >= total_steps
                metrics = self.async_train_step(rows, None if last else upcoming[2])
            else:
                metrics = self.train_step(rows)
            self._finish_step(metrics, tick, epoch, step_in_epoch, total_steps)

    def _finish_step(
        self, metrics: dict[str, float], tick: float, epoch: int, step_in_epoch: int, total_steps: int
    ) -> None:
        """After a step's update and sync: count it, then evaluation, checkpoint, export, logging."""
        t = self.cfg.trainer
        self.state.global_step += 1
        self.state.epoch, self.state.step_in_epoch = epoch, step_in_epoch + 1
        step = self.state.global_step
        if t.eval_interval > 0 and (step % t.eval_interval == 0 or step == total_steps):
            metrics.update(self.evaluate())
        if t.ckpt_interval > 0 and (step % t.ckpt_interval == 0 or step == total_steps):
            metrics["checkpoint"] = 1.0
            self.save_checkpoint()
        if t.hf_save_interval > 0 and step % t.hf_save_interval == 0:
            self.export()
        self._log(self._step_figures(metrics, tick))
        self.console.step_done(step, total_steps, metrics)

    def _fit_fully_async(
        self, batches: Iterator[tuple[int, int, list[PromptSample]]], total_steps: int
    ) -> None:
        """Fully async (`trainer.fully_async`, design in `skylift.trainer.fully_async`): the batches'
        rows are generated continuously on the loop's own thread; each step takes a batch of groups."""
        t = self.cfg.trainer
        assert self.weights is not None
        self.weights.label()
        loop = LoopThread(self.runtime.loop)
        try:
            stream = FullyAsyncRollouts(
                loop,
                PromptSource(rows_of(batches, self.state.global_step)),
                self._group_rollout,
                lambda: self.engine_version,
                batch_size=t.train_batch_size,
                max_staleness=t.fully_async.max_staleness_steps,
                workers=t.fully_async.num_parallel_generation_workers or t.train_batch_size,
                timeout_s=self.cfg.generator.http_timeout_s,
            )
        except BaseException:
            loop.stop()
            raise
        try:
            while self.state.global_step < total_steps:
                tick = time.perf_counter()
                epoch, step_in_epoch = self.runtime.train_data.locate(
                    self.state.global_step, t.train_batch_size
                )
                metrics = self.fully_async_train_step(stream)
                self._finish_step(metrics, tick, epoch, step_in_epoch, total_steps)
        finally:
            stream.close()

    def fully_async_train_step(self, stream: FullyAsyncRollouts) -> dict[str, float]:
        """One fully async step: take a batch of groups, update, sync (pausing the engines)."""
        tick = time.perf_counter()
        trajectories, stream_metrics = stream.take(self.state.policy_version)
        metrics = self.update(trajectories)
        metrics.update(self._sync_after_update())
        stream.notify_version()
        metrics.update(stream_metrics)
        busy = time.perf_counter() - tick - metrics["timing/weight_sync_s"]  # engines paused only to sync
        metrics.update(
            {"timing/generate_s": max(0.0, busy), "timing/wait_s": stream_metrics["fully_async/wait_s"]}
        )
        return metrics

    def _group_rollout(self, row: PromptSample, step: int, engine_version: int) -> Any:
        """The generation coroutine of one prompt's group (fully async), seeded as at `step`."""
        seeds = rollout_seeds(self.cfg, [row], step)
        params = sampling_params(self.cfg, False)
        n = self.cfg.generator.n_samples_per_prompt
        return self.runtime.generator.generate([row], n, params, engine_version, seeds)

    def train_step(self, rows: list[PromptSample]) -> dict[str, float]:
        """One synchronous step: generate, update the policy on the rollouts, sync the weights."""
        assert self.weights is not None
        tick = time.perf_counter()
        trajectories = self.generate(self.first_round(rows))
        trajectories, fill_metrics = self.fill_batch(trajectories)
        generate_s = time.perf_counter() - tick
        if self.runtime.colocation.sleep_engines:  # free the shared devices for training
            self.weights.sleep()
        metrics = self.update(trajectories)
        metrics.update(self._sync_after_update())
        metrics.update({"timing/generate_s": generate_s, "timing/wait_s": generate_s, **fill_metrics})
        return metrics

    def async_train_step(
        self, rows: list[PromptSample], next_rows: list[PromptSample] | None
    ) -> dict[str, float]:
        """One step of one-step-off training: `next_rows` are generated while `rows` train."""
        assert self.rollouts is not None
        wait_s = generate_s = 0.0
        if not self.rollouts.pending:  # the first step: nothing was launched ahead
            self.rollouts.launch(self._rollout(self.first_round(rows)))
            wait_s, generate_s = self.rollouts.join()
        trajectories = self.rollouts.take()
        tick = time.perf_counter()  # extra rounds of dynamic sampling run before the next launch
        trajectories, fill_metrics = self.fill_batch(trajectories)
        filled_s = time.perf_counter() - tick if fill_metrics else 0.0
        if next_rows is not None:
            self.rollouts.launch(self._rollout(self.first_round(next_rows, ahead=1), ahead=1))
        metrics = self.update(trajectories)
        waited, generated = self.rollouts.join()  # no generation may be in flight during the sync
        metrics.update(self._sync_after_update())
        metrics.update(
            {
                "timing/generate_s": generate_s + generated + filled_s,
                "timing/wait_s": wait_s + waited + filled_s,
                **fill_metrics,
            }
        )
        return metrics

    def first_round(self, rows: list[PromptSample], ahead: int = 0) -> list[PromptSample]:
        """The step's rows plus, when dynamic sampling oversamples (`gen_batch_size` above
        `train_batch_size`), that many more of the step's own draw of the data (`ahead` steps on)."""
        extra = self._prompts_per_round() - self.cfg.trainer.train_batch_size
        if self.cfg.trainer.algorithm.dynamic_sampling.type is None or extra <= 0:
            return rows
        step = self.state.global_step + ahead
        return [*rows, *self._step_draw(step, 0, extra, {row.uid for row in rows})]

    def _prompts_per_round(self) -> int:
        t = self.cfg.trainer
        size = t.algorithm.dynamic_sampling.gen_batch_size
        return t.train_batch_size if size == -1 else size

    def _step_draw(self, step: int, start: int, count: int, taken: set[str]) -> list[PromptSample]:
        """Rows `start..start + count` of step `step`'s seeded draw of the data, skipping the prompt
        uids `taken` (see `dynamic_sampling.step_rows`)."""
        data = self.runtime.train_data
        index = step_rows(
            len(data), self.cfg.trainer.seed, step, start, count, lambda i: data[i].uid in taken
        )
        return [data[i] for i in index]

    def fill_batch(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        """Dynamic sampling (`trainer.algorithm.dynamic_sampling`): the step's batch made of groups
        whose rewards differ, sampling extra rounds of prompts when needed (see `dynamic_sampling`)."""
        t = self.cfg.trainer
        ds = t.algorithm.dynamic_sampling
        if ds.type is None:
            return trajectories, {}
        step, per_round = self.state.global_step, self._prompts_per_round()
        first = {tr.uid for tr in trajectories}

        def sample_round(round_index: int) -> list[Trajectory]:
            rows = self._step_draw(step, (round_index - 1) * per_round, per_round, first)
            return self.generate(rows) if rows else []

        out = dynamic_sample(
            trajectories,
            sample_round,
            ds.type,
            t.train_batch_size,
            None if ds.max_sample_batches == -1 else ds.max_sample_batches,
            ds.min_replace_ratio,
            seed=t.seed + step,
        )
        if out.short:
            self.console.say(
                f"step {step + 1}: dynamic sampling ({ds.type}) found {out.groups_kept} of "
                f"{t.train_batch_size} prompt groups with mixed rewards in {out.rounds} round(s) "
                f"({out.groups_sampled} groups sampled); training on what there is"
            )
        metrics = {
            "dynamic_sampling/groups_sampled": float(out.groups_sampled),
            "dynamic_sampling/groups_kept": float(out.groups_kept),
            "dynamic_sampling/rounds": float(out.rounds),
        }
        return out.trajectories, metrics

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Experience (logprobs, values, advantages) -> critic and policy updates; the version goes up."""
        rt, t = self.runtime, self.cfg.trainer
        assert rt.policy is not None
        sampling = as_distribution(self.update_settings.temperature)  # KLs: untruncated (full())
        experience = make_experience(
            trajectories,
            dataclasses.replace(self.experience_settings, kl_coef=self.kl_ctrl.value),
            self.state.policy_version,
            policy_logprobs=self._logprobs_of(rt.policy, sampling),
            ref_logprobs=self._logprobs_of(rt.ref, sampling.full()) if rt.ref is not None else None,
            full_policy_logprobs=self._logprobs_of(rt.policy, sampling.full())
            if sampling.truncates
            else None,
            values=(
                (lambda b: rt.critic.compute_values(b, t.micro_forward_batch_size_per_gpu))  # type: ignore[union-attr]
                if rt.critic is not None
                else None
            ),
        )
        if "kl_in_reward/kl_seq_mean" in experience.metrics:  # the next step's coefficient
            self.kl_ctrl.update(experience.metrics["kl_in_reward/kl_seq_mean"], experience.batch.batch_size)
            self.state.extra["kl_coef"] = self.kl_ctrl.value  # saved with checkpoints
        metrics: dict[str, float] = {}
        if rt.critic is not None:
            tick = time.perf_counter()
            metrics.update(train_critic(rt.critic, experience.batch, self.update_settings))
            metrics["timing/critic_train_s"] = time.perf_counter() - tick
        tick = time.perf_counter()
        metrics.update(train_policy(rt.policy, experience.batch, self.objective, self.update_settings))
        metrics["timing/train_s"] = time.perf_counter() - tick
        self.state.policy_version += 1
        # last: the experience's rollout gap (trainer's old logprobs, before any update) wins
        metrics.update(experience.metrics)
        return metrics

    def _logprobs_of(self, group: WorkerGroup, sampling: TokenDistribution) -> Any:
        forward_batch = self.cfg.trainer.micro_forward_batch_size_per_gpu
        return lambda batch: group.compute_logprobs(batch, forward_batch, sampling)

    def _sync_after_update(self) -> dict[str, float]:
        """Broadcast the new weights unless async staleness allows the engines to lag behind."""
        assert self.weights is not None
        t = self.cfg.trainer
        tick = time.perf_counter()
        self.weights.sync_if_needed(self.state.policy_version, t.async_training, t.max_staleness_steps)
        return {"timing/weight_sync_s": time.perf_counter() - tick}

    def _step_figures(self, metrics: dict[str, float], started: float) -> dict[str, float]:
        engines = self.runtime.engines
        if engines is not None and engines.failures:
            metrics["engines/live"] = float(len(engines.live_indices))
        metrics["timing/step_s"] = time.perf_counter() - started
        # engines idle: the step's time with no generation running (evaluation counts as busy)
        busy = metrics["timing/generate_s"] + metrics.get("timing/eval_s", 0.0)
        metrics["timing/idle_s"] = max(0.0, metrics["timing/step_s"] - busy)
        return metrics

    # ================================================================== rollouts
    def generate(self, rows: list[PromptSample], evaluation: bool = False) -> list[Trajectory]:
        return self.runtime.run(self._rollout(rows, evaluation))

    def _rollout(self, rows: list[PromptSample], evaluation: bool = False, ahead: int = 0) -> Any:
        """The generation coroutine of the next step's rows (`ahead` steps further for async runs,
        or evaluation); its trajectories record the engines' policy version now."""
        g = self.cfg.generator
        n = g.eval_n_samples_per_prompt if evaluation else g.n_samples_per_prompt
        step = -1 if evaluation else self.state.global_step + ahead
        seeds = rollout_seeds(self.cfg, rows, step)
        params = sampling_params(self.cfg, evaluation)
        return self.runtime.generator.generate(rows, n, params, self.engine_version, seeds)

    # ================================================================== evaluation
    def evaluate(self) -> dict[str, float]:
        rt = self.runtime
        if rt.val_data is None or len(rt.val_data) == 0:
            return {}
        assert self.weights is not None
        if self.weights.version != self.state.policy_version:  # async runs may skip syncs
            self.weights.sync(self.state.policy_version)
        metrics, trajectories = evaluate(
            list(rt.val_data),
            lambda rows: self.generate(rows, evaluation=True),
            self.cfg.trainer.eval_batch_size,
        )
        if self.cfg.trainer.dump_eval_results:
            dump_eval(rt.paths.logs / "eval" / f"step_{self.state.global_step}.jsonl", trajectories)
        return metrics

    # ================================================================== checkpoints
    def save_checkpoint(self) -> Path:
        rt, step = self.runtime, self.state.global_step
        assert rt.policy is not None
        tmp = ckpt.begin_checkpoint(rt.paths.ckpt, step)
        rt.policy.call_all("save_checkpoint", str(tmp / "policy"))
        if rt.critic is not None:
            rt.critic.call_all("save_checkpoint", str(tmp / "critic"))
        return ckpt.commit_checkpoint(rt.paths.ckpt, step, self.state, self.cfg.trainer.max_ckpts_to_keep)

    def export(self) -> str:
        assert self.runtime.policy is not None
        target = self.runtime.paths.export / f"global_step_{self.state.global_step}"
        return str(self.runtime.policy.call_all("export_hf", str(target))[0])

    def _maybe_resume(self) -> bool:
        """Load the checkpoint `resume_mode` asks for, if any, and push its weights to the engines."""
        t, rt = self.cfg.trainer, self.runtime
        mode = (t.resume_mode or "none").lower()
        if mode == "none":
            return False
        path = (
            Path(t.resume_path).expanduser()
            if mode == "from_path" and t.resume_path
            else ckpt.latest_checkpoint(rt.paths.ckpt)
        )
        if path is None:
            return False
        assert rt.policy is not None and self.weights is not None
        self.state = ckpt.load_trainer_state(path)
        self.kl_ctrl.value = float(self.state.extra.get("kl_coef", self.kl_ctrl.value))
        rt.policy.call_all("load_checkpoint", str(path / "policy"))
        if rt.critic is not None:
            rt.critic.call_all("load_checkpoint", str(path / "critic"))
        self.weights.sync(self.state.policy_version)
        self.console.say(f"resumed from {path} (step {self.state.global_step})")
        return True

    def _stop_after_engine_loss(self, exc: EngineUnavailableError) -> TrainingStoppedError:
        """Save the last completed step (engines fail in generation, before a step changes the
        policy, or in a sync after it counted) and explain how to continue."""
        step = self.state.global_step
        what = "all inference engines failed" if isinstance(exc, NoHealthyEngineError) else "an engine failed"
        if step == 0:
            saved = "nothing to save: no step had completed"
        elif (
            latest := ckpt.latest_checkpoint(self.runtime.paths.ckpt)
        ) is not None and latest.name == f"global_step_{step}":
            saved = f"step {step} was already checkpointed at {latest}"
        else:
            saved = f"saved step {step} to {self.save_checkpoint()}"
        self.console.say(f"stopping: {what} during step {step + 1}; {saved}")
        return TrainingStoppedError(
            f"training stopped during step {step + 1}: {exc}. {saved.capitalize()}. Bring the engines "
            "back and rerun the same command with trainer.resume_mode=latest to continue."
        )

    def _log(self, metrics: dict[str, float]) -> None:
        self.runtime.tracking.log(metrics, self.state.global_step)
        self.history.append({"step": self.state.global_step, **metrics})

    # ================================================================== the parts, for tools and tests
    @property
    def engine_version(self) -> int:
        """The policy version of the weights the engines hold."""
        return self.weights.version if self.weights is not None else 0

    @property
    def engines(self) -> EnginePool | None:
        return self.runtime.engines

    @property
    def policy(self) -> WorkerGroup | None:
        return self.runtime.policy

    @property
    def loop(self) -> Any:
        return self.runtime.loop

    @property
    def pad_id(self) -> int:
        return self.runtime.pad_id

    @property
    def paths(self) -> Any:
        return self.runtime.paths

    def shutdown(self) -> None:
        self.runtime.close()
