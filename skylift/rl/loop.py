"""The RL loop (GRPO and friends), read top to bottom.

One step (`RLTrainer.step`): take the step's rollouts from the source -> experience (reference
logprobs, values, advantages: `experience.py`) -> update (policy and critic mini-batches:
`update.py`) -> sync (weights to the engines) -> evaluate -> checkpoint.

The trainer is given its parts (`parts.py`: engines, worker groups, data, trackers, built by
`skylift.cluster.runtime`) and a rollout source (`sources.py`: synchronous, one-step-off or fully
async, dynamic sampling around any of them); it does not know the algorithm either: advantages,
losses and reductions are looked up by name in `skylift.algorithms`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from skylift.algorithms import make_kl_controller
from skylift.algorithms.sample_support import TokenDistribution, as_distribution
from skylift.config.schema import SkyliftConfig
from skylift.generator import Trajectory
from skylift.generator.rollout_errors import rollout_input
from skylift.inference.pool import NoHealthyEngineError
from skylift.inference.types import EngineUnavailableError
from skylift.rl import checkpoint as ckpt
from skylift.rl.batch_dump import batch_dump_path, dump_training_batch
from skylift.rl.console import Console
from skylift.rl.eval_dumps import EvalDump, write_eval_dumps
from skylift.rl.evaluation import dump_eval, evaluate
from skylift.rl.experience import ExperienceStages, make_experience
from skylift.rl.fully_async import RolloutsExhausted
from skylift.rl.parts import ModelGroup, Parts
from skylift.rl.rollout_records import RolloutRecorder
from skylift.rl.sampling import Sampler
from skylift.rl.sources import RolloutSource
from skylift.rl.step_wise import is_step_wise, step_wise_rows_per_mini_batch
from skylift.rl.update import UpdateSettings, policy_objective, train_critic, train_policy
from skylift.utils.messages import one_line, plain
from skylift.utils.threads import switch_interval

logger = logging.getLogger(__name__)


class TrainingStoppedError(RuntimeError):
    """Training cannot go on (e.g. every inference engine failed); what could be saved was saved
    and the message says how to continue."""


class RolloutInputStoppedError(TrainingStoppedError):
    """Training stopped on a rollout that failed on the user's input (`rollout_input`: a dataset
    row, an environment, a request the engine refused); saved as `TrainingStoppedError`."""


class RLTrainer:
    """Trains the policy of `parts` on the rollouts of `source`: `setup()` resumes or starts,
    `fit()` runs every step, `shutdown()` ends the run."""

    def __init__(
        self,
        cfg: SkyliftConfig,
        parts: Parts,
        source: RolloutSource,
        evaluation: Sampler | None,
        total_steps: int,
        console: Console | None = None,
    ) -> None:
        """`evaluation`: how held-out prompts are sampled (None: no evaluation)."""
        self.cfg, self.parts, self.source, self.eval_sampler = cfg, parts, source, evaluation
        self.total_steps = total_steps
        self.console = console or Console(False)
        self.state = ckpt.TrainerState()
        self.history: list[dict[str, float]] = []
        t = cfg.trainer
        kl = t.algorithm.kl_ctrl  # the KL-in-reward coefficient, adapted per step or fixed
        self.kl_ctrl = make_kl_controller(kl.type, t.algorithm.kl_loss_coef, kl.kl_target, kl.horizon)
        self.experience_stages = ExperienceStages.from_config(cfg, parts.pad_id)
        self.update_settings = UpdateSettings.from_config(cfg, source.sampler.params)
        self.objective = policy_objective(cfg)
        self.close_parts: Any = None  # set by `build_trainer`: takes down what it built
        self.records = RolloutRecorder.from_parts(  # for skylift view
            cfg, parts, self.update_settings.temperature, self.console.say
        )
        self.started_at = time.perf_counter()

    def setup(self) -> None:
        """Load the checkpoint `trainer.resume_mode` asks for, if any; make the engines hold this
        run's weights."""
        if not self._resume() and not self.cfg.generator.run_engines_locally:
            self.parts.weights.sync(self.state.policy_version)  # a server may hold another run's
        self.console.say(f"set-up done in {time.perf_counter() - self.started_at:.1f} s")

    # ================================================================== the loop
    def fit(self) -> list[dict[str, float]]:
        try:
            if self.cfg.trainer.eval_before_train and self.state.global_step == 0:
                metrics = self.evaluate()
                if metrics:
                    self._log(metrics)
                    self.console.say(f"step 0 | eval accuracy {metrics['eval/accuracy']:.3f}")
            self.console.start_progress(self.total_steps, self.state.global_step)
            with switch_interval() if self.source.overlapped else contextlib.nullcontext():
                while self.state.global_step < self.total_steps:
                    self.step()
        except RolloutsExhausted as exc:
            if not self.source.may_run_out:
                raise
            self._end_early(exc)
        except EngineUnavailableError as exc:
            raise self._stop_after_engine_loss(exc) from exc
        except Exception as exc:
            if (line := rollout_input(exc)) is None:
                raise  # not the user's input: a bug, its traceback kept
            raise self._stop_after_bad_input(line) from exc
        finally:
            self.source.close()
            self.console.close_progress()
        return self.history

    def step(self) -> dict[str, float]:
        """One training step; returns its metrics (also logged)."""
        t, parts = self.cfg.trainer, self.parts
        tick, step = time.perf_counter(), self.state.global_step
        rollouts = self.source.take(step, self.state.policy_version)
        self.source.prefetch(step + 1)  # generated while this step trains, if the source overlaps
        if parts.sleep_engines:  # colocated on GPUs: free the engines' memory for training
            parts.weights.sleep()
        metrics = self.update(rollouts.trajectories)
        metrics.update(self.sync())
        metrics.update(rollouts.metrics)
        metrics.update(self.source.timing().metrics())
        epoch, index = divmod(step, self._batches_per_epoch())
        self.state.global_step, self.state.epoch, self.state.step_in_epoch = step + 1, epoch, index + 1
        done = self.state.global_step
        if t.eval_interval > 0 and (done % t.eval_interval == 0 or done == self.total_steps):
            metrics.update(self.evaluate())
        if t.ckpt_interval > 0 and (done % t.ckpt_interval == 0 or done == self.total_steps):
            metrics["checkpoint"] = 1.0
            self.save_checkpoint()
        if t.hf_save_interval > 0 and done % t.hf_save_interval == 0:
            self.export()
        self._log(self._step_figures(metrics, tick))
        self.console.step_done(done, self.total_steps, metrics)
        return metrics

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Experience (logprobs, values, advantages) -> critic and policy updates; the version goes up."""
        policy, critic, ref = self.parts.policy, self.parts.critic, self.parts.ref
        sampling = as_distribution(self.update_settings.temperature)  # KLs: untruncated (full())
        experience = make_experience(
            trajectories,
            self.experience_stages.with_kl_coef(self.kl_ctrl.value),
            self.state.policy_version,
            policy_logprobs=self._logprobs_of(policy, sampling),
            ref_logprobs=self._logprobs_of(ref, sampling.full()) if ref is not None else None,
            full_policy_logprobs=self._logprobs_of(policy, sampling.full()) if sampling.truncates else None,
            values=self._values_of(critic) if critic is not None else None,
        )
        if "kl_in_reward/kl_seq_mean" in experience.metrics:  # the next step's coefficient
            self.kl_ctrl.update(experience.metrics["kl_in_reward/kl_seq_mean"], experience.batch.batch_size)
            self.state.extra["kl_coef"] = self.kl_ctrl.value  # saved with checkpoints
        metrics = self.records.step(self.state.global_step + 1, experience, trajectories)
        if self.cfg.trainer.dump_data_batch:  # a debugging dump; its step count is 1-based
            tick = time.perf_counter()
            path = batch_dump_path(self.parts.export_dir, self.state.global_step + 1)
            dump_training_batch(path, experience, trajectories)
            metrics["timing/dump_data_batch_s"] = time.perf_counter() - tick
        if critic is not None:
            tick = time.perf_counter()
            metrics.update(train_critic(critic, experience.batch, self.update_settings))
            metrics["timing/critic_train_s"] = time.perf_counter() - tick
        tick = time.perf_counter()
        settings = self.update_settings
        if is_step_wise(trajectories):  # as many optimizer steps as with one sample per rollout
            rows = step_wise_rows_per_mini_batch(settings.rows_per_mini_batch, trajectories)
            settings = dataclasses.replace(settings, rows_per_mini_batch=rows)
        metrics.update(train_policy(policy, experience.batch, self.objective, settings))
        metrics["timing/train_s"] = time.perf_counter() - tick
        self.state.policy_version += 1
        # last: the experience's rollout gap (trainer's old logprobs, before any update) wins
        metrics.update(experience.metrics)
        return metrics

    def sync(self) -> dict[str, float]:
        """Push the new weights to the engines, unless the source lets them lag behind."""
        weights, version = self.parts.weights, self.state.policy_version
        tick = time.perf_counter()
        self.source.before_sync()
        pushed = weights.sync(version) if self.source.needs_sync(version, weights.version) else {}
        self.source.after_sync(version)
        return {**pushed, "timing/weight_sync_s": time.perf_counter() - tick}

    # ================================================================== evaluation
    def evaluate(self) -> dict[str, float]:
        val = self.parts.val_data
        if self.eval_sampler is None or val is None or len(val) == 0:
            return {}
        if self.parts.weights.version != self.state.policy_version:  # async runs may skip syncs
            self.parts.weights.sync(self.state.policy_version)
        sampler = self.eval_sampler
        metrics, trajectories = evaluate(
            list(val),
            lambda rows: sampler.run(rows, -1),
            self.cfg.trainer.eval_batch_size,
            self.cfg.generator.eval_n_samples_per_prompt,
        )
        self.records.evaluation(self.state.global_step, trajectories)
        if self.cfg.trainer.dump_eval_results:
            step = self.state.global_step
            dump_eval(self.parts.logs_dir / "eval" / f"step_{step}.jsonl", trajectories)
            if self.parts.decode is not None:  # and in the registered dumpers' layouts
                p = self.parts
                write_eval_dumps(EvalDump(p.export_dir, step, list(val), trajectories, metrics, p.decode))
        return metrics

    # ================================================================== checkpoints
    def save_checkpoint(self) -> Path:
        parts, step = self.parts, self.state.global_step
        tmp = ckpt.begin_checkpoint(parts.ckpt_dir, step)
        parts.policy.save_checkpoint(str(tmp / "policy"))
        if parts.critic is not None:
            parts.critic.save_checkpoint(str(tmp / "critic"))
        self.state.rollouts = self.source.state()  # where generation is in the data, at this instant
        return ckpt.commit_checkpoint(parts.ckpt_dir, step, self.state, self.cfg.trainer.max_ckpts_to_keep)

    def export(self) -> str:
        return self.parts.policy.export_hf(
            str(self.parts.export_dir / f"global_step_{self.state.global_step}")
        )

    def _resume(self) -> bool:
        """Load the checkpoint `resume_mode` asks for, if any, and push its weights to the engines."""
        t, parts = self.cfg.trainer, self.parts
        mode = (t.resume_mode or "none").lower()
        if mode == "none":
            return False
        path = (
            Path(t.resume_path).expanduser()
            if mode == "from_path" and t.resume_path
            else ckpt.latest_checkpoint(parts.ckpt_dir)
        )
        if path is None:
            return False
        self.state = ckpt.load_trainer_state(path)
        self.source.restore(self.state.rollouts)
        self.kl_ctrl.value = float(self.state.extra.get("kl_coef", self.kl_ctrl.value))
        parts.policy.load_checkpoint(str(path / "policy"))
        if parts.critic is not None:
            parts.critic.load_checkpoint(str(path / "critic"))
        parts.weights.sync(self.state.policy_version)
        self.console.say(f"resumed from {path} (step {self.state.global_step})")
        return True

    def _end_early(self, exc: RolloutsExhausted) -> None:
        """The data ran out before the last step (groups were dropped as they finished): the
        partial batch is discarded and the run ends with a checkpoint and an export, as at its end."""
        t, done = self.cfg.trainer, self.state.global_step
        self.console.say(f"{exc}; the run ends after step {done} of {self.total_steps}")
        if t.ckpt_interval > 0 and done > 0 and done % t.ckpt_interval != 0:
            self.save_checkpoint()
        if t.hf_save_interval > 0 and done > 0 and done % t.hf_save_interval != 0:
            self.export()

    def _stop_after_engine_loss(self, exc: EngineUnavailableError) -> TrainingStoppedError:
        """Save the last completed step (engines fail in generation, before a step changes the
        policy, or in a sync after it counted) and explain how to continue."""
        step = self.state.global_step
        what = "all inference engines failed" if isinstance(exc, NoHealthyEngineError) else "an engine failed"
        saved = self._save_completed_step()
        self.console.say(f"stopping: {what} during step {step + 1}; {saved}")
        logger.info("training stopped during step %d: %s", step + 1, plain(str(exc)))  # the detail
        # the cause on one line (no colours, no remote traceback); a path keeps its case
        return TrainingStoppedError(
            f"training stopped during step {step + 1}: {one_line(str(exc))}. {saved[:1].upper()}{saved[1:]}. "
            "Bring the engines back and rerun the same command with trainer.resume_mode=latest to continue."
        )

    def _stop_after_bad_input(self, line: str) -> RolloutInputStoppedError:
        """A rollout failed on the user's input (in generation or evaluation, before the step
        changed the policy): save the last completed step and say what to fix."""
        step = self.state.global_step
        saved = self._save_completed_step()
        logger.info("training stopped during step %d: %s", step + 1, line)
        return RolloutInputStoppedError(
            f"rollout failed during step {step + 1}: {line}. {saved[:1].upper()}{saved[1:]}. Fix the data, "
            "the environment or the limit and rerun the same command with trainer.resume_mode=latest "
            "to continue (--verbose shows the traceback)"
        )

    def _save_completed_step(self) -> str:
        """Checkpoint the last completed step unless it is (or none is); says which."""
        step = self.state.global_step
        if step == 0:
            saved = "nothing to save: no step had completed"
        elif (
            latest := ckpt.latest_checkpoint(self.parts.ckpt_dir)
        ) is not None and latest.name == f"global_step_{step}":
            saved = f"step {step} was already checkpointed at {latest}"
        else:
            saved = f"saved step {step} to {self.save_checkpoint()}"
        return saved

    # ================================================================== helpers
    def _batches_per_epoch(self) -> int:
        return max(1, self.parts.train_data.num_batches(self.cfg.trainer.train_batch_size))

    def _logprobs_of(self, group: ModelGroup, sampling: TokenDistribution) -> Any:
        """The group's logprobs of the rollout tokens under `sampling` (see `sample_support`)."""
        forward_batch = self.cfg.trainer.micro_forward_batch_size_per_gpu
        return lambda batch: group.compute_logprobs(batch, forward_batch, sampling)

    def _values_of(self, group: ModelGroup) -> Any:
        return lambda batch: group.compute_values(batch, self.cfg.trainer.micro_forward_batch_size_per_gpu)

    def _step_figures(self, metrics: dict[str, float], started: float) -> dict[str, float]:
        engines = self.parts.engines
        if engines is not None and engines.failures:
            metrics["engines/live"] = float(len(engines.live_indices))
        metrics["timing/step_s"] = time.perf_counter() - started
        # engines idle: the step's time with no generation running (evaluation counts as busy)
        busy = metrics["timing/generate_s"] + metrics.get("timing/eval_s", 0.0)
        metrics["timing/idle_s"] = max(0.0, metrics["timing/step_s"] - busy)
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        self.parts.tracking.log(metrics, self.state.global_step)
        self.history.append({"step": self.state.global_step, **metrics})

    def shutdown(self) -> None:
        if self.close_parts is not None:
            self.close_parts()
