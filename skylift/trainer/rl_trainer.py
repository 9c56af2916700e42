"""The synchronous RL loop (GRPO and friends).

One step: sample `n_samples_per_prompt` responses per prompt -> environment rewards -> reference
logprobs (when a KL term is used) -> advantages -> policy mini-batch updates -> weight sync to
the engines -> evaluation / checkpoint. The loop does not know the algorithm: advantages, losses
and reductions are looked up by name in `skylift.algorithms`.

With `trainer.async_training=true` the generation of step t+1 overlaps the training of step t
(one-step-off; design and off-policy correction in `skylift.trainer.async_rollouts`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from skylift.algorithms import (
    PolicyLossConfig,
    apply_kl_penalty,
    compute_advantages,
    masked_whiten,
    mini_batch_totals,
    sequence_rewards_to_token_level,
)
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptDataset, PromptSample
from skylift.generator import Generator, GeneratorSettings, Trajectory
from skylift.generator.generator import rollout_seed
from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.inference.types import EngineUnavailableError, SamplingParams
from skylift.trainer import checkpoint as ckpt
from skylift.trainer.async_rollouts import (
    BackgroundRollouts,
    ColocationPlan,
    check_staleness,
    colocation_plan,
    needs_weight_sync,
    ppo_old_logprobs_source,
    staleness_metrics,
    with_next,
)
from skylift.trainer.engines import (
    EngineRef,
    remote_engine_refs,
    start_inprocess_engines,
    start_local_engines,
)
from skylift.trainer.objective import PolicyObjective, ValueObjective, rows_with_policy_gradient
from skylift.trainer.settings import (
    RunPaths,
    critic_worker_settings,
    local_engine_kwargs,
    max_generate_length,
    model_worker_settings,
    start_ray_run,
)
from skylift.trainer.workers import WorkerGroup
from skylift.training.batch import SequenceBatch, build_sequence_batch
from skylift.training.worker import WorkerSettings


class TrainingStoppedError(RuntimeError):
    """Training cannot go on (e.g. every inference engine failed); what could be saved was saved
    and the message says how to continue."""


def _override_flag(value: str | bool) -> bool:
    return str(value).lower() in ("true", "enable", "1", "yes", "auto")


class RLTrainer:
    """Builds everything a run needs from a `SkyliftConfig`, then `fit()` trains."""

    def __init__(self, cfg: SkyliftConfig, *, console: bool = True) -> None:
        self.cfg = cfg
        self.console = console
        self.paths = RunPaths.from_config(cfg)
        self.state = ckpt.TrainerState()
        self.loop = asyncio.new_event_loop()
        self.engine_refs: list[EngineRef] = []
        self.engines: EnginePool | None = None
        self.policy: WorkerGroup | None = None
        self.ref: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.history: list[dict[str, float]] = []
        self._ray_started = False
        self.placement: Any = None  # PlacedGroups when the run uses Ray
        self.engine_version = 0  # the policy version of the weights the engines hold
        self.colocation = ColocationPlan(sleep_engines=False)
        self._engines_asleep = False
        self._sync_members: list[int] = []  # pool indices of the engines in the weight-update group
        self.rollouts: BackgroundRollouts[list[Trajectory]] | None = None  # async_training only

    # ================================================================== set-up
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from skylift.models import resolve_model_path
        from skylift.tracking import Tracking

        cfg, t, g = self.cfg, self.cfg.trainer, self.cfg.generator
        started = time.perf_counter()
        self.model_path = resolve_model_path(t.policy.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        env_class = cfg.environment.env_class
        self.train_data = PromptDataset(
            cfg.data.train_data, default_env_class=env_class, max_rows=cfg.data.max_train_samples
        )
        self.val_data = (
            PromptDataset(cfg.data.val_data, default_env_class=env_class, max_rows=cfg.data.max_val_samples)
            if cfg.data.val_data
            else None
        )
        self.tracking = Tracking(t.loggers(), self.paths.logs, t.project_name, t.run_name)
        self._say(
            f"run '{t.run_name}': model {t.policy.model.path}, {len(self.train_data)} train prompts, "
            f"{len(self.val_data) if self.val_data else 0} eval prompts; outputs in {self.paths.root}"
        )

        world = t.policy_world_size()
        backend = t.placement.backend
        use_ray = backend == "ray" or (backend == "auto" and (g.run_engines_locally or world > 1))
        self.use_ray = use_ray
        self.colocation = colocation_plan(
            t.placement.colocate_all, torch.cuda.is_available(), g.run_engines_locally
        )
        if self.colocation.message:
            self._say(self.colocation.message)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported; users may override
        if use_ray:
            self._init_ray()
        self._start_engines()
        self.policy = self._worker_group(
            "policy", model_worker_settings(self.cfg, True, self._total_steps()), world, use_ray
        )
        self.policy.setup()
        if t.algorithm.use_kl_loss or t.algorithm.use_kl_in_reward:
            ref_world = t.placement.ref_num_nodes * t.placement.ref_num_gpus_per_node
            self.ref = self._worker_group(
                "ref", model_worker_settings(self.cfg, False, self._total_steps()), ref_world, use_ray
            )
            self.ref.setup()
        if t.algorithm.advantage_estimator == "gae":
            critic_world = t.placement.critic_num_nodes * t.placement.critic_num_gpus_per_node
            self.critic = self._worker_group(
                "critic", critic_worker_settings(self.cfg, self._total_steps()), critic_world, use_ray
            )
            self.critic.setup()
        sync_address = self.policy.call_all(
            "init_weight_sync",
            self.engine_refs,
            _override_flag(g.override_existing_update_group),
            self._weight_sync_backend,
            g.weight_sync_timeout_s,
            g.weight_sync_master_address,
        )[0]
        self._say(f"weight sync: {len(self.engine_refs)} engine(s) dial {sync_address}")
        self._sync_members = list(range(len(self.engine_refs)))
        if not self._maybe_resume() and not g.run_engines_locally:
            # a server may still hold another run's weights: start from this run's
            self._sync_weights()
        self.generator = Generator(
            self.engines,
            self.tokenizer,
            GeneratorSettings(
                max_prompt_length=t.max_prompt_length,
                max_generate_length=self._max_gen_len(),
                max_turns=g.max_turns,
                max_input_length=g.max_input_length,
                zero_reward_on_non_stop=g.zero_reward_on_non_stop,
                apply_overlong_filtering=g.apply_overlong_filtering,
                env_kwargs=dict(cfg.environment.env_kwargs),
                default_env_class=env_class,
            ),
        )
        self._say(f"set-up done in {time.perf_counter() - started:.1f} s")

    def _worker_group(self, name: str, settings: WorkerSettings, world: int, use_ray: bool) -> WorkerGroup:
        gpu = torch.cuda.is_available()
        return WorkerGroup(
            name,
            settings,
            world,
            use_ray=use_ray,
            num_cpus_per_worker=1 if gpu else 0,
            num_gpus_per_worker=1 if gpu else 0,
            loop=self.loop,
            timeout_s=self.cfg.trainer.worker_timeout_s,
            placement=self.placement,
        )

    def _init_ray(self) -> None:
        run = start_ray_run(self.cfg)
        self._ray_started, self.placement = run.started, run.placement
        for line in run.lines:
            self._say(line)

    def _start_engines(self) -> None:
        g = self.cfg.generator
        if g.run_engines_locally:
            kwargs = local_engine_kwargs(self.cfg, sleep_mode=self.colocation.sleep_engines)
            started = time.perf_counter()
            where = "as Ray actors" if self.use_ray else "in this process"
            self._say(f"starting {g.num_inference_engines} local vLLM engine(s) {where}...")
            if self.use_ray:
                self.engine_refs = start_local_engines(
                    g.num_inference_engines,
                    self.model_path,
                    kwargs,
                    startup_timeout_s=g.engine_startup_timeout_s,
                    call_timeout_s=g.http_timeout_s,
                    placement=self.placement,
                )
            else:
                self.engine_refs = self.loop.run_until_complete(
                    asyncio.wait_for(
                        start_inprocess_engines(g.num_inference_engines, self.model_path, kwargs),
                        g.engine_startup_timeout_s,
                    )
                )
            self._say(f"engines up in {time.perf_counter() - started:.1f} s")
        else:
            self.engine_refs = remote_engine_refs(
                list(g.remote_inference_engine_urls), os.environ.get("SKYLIFT_API_KEY"), g.http_timeout_s
            )
        self.engines = EnginePool([ref.connect() for ref in self.engine_refs])

    def _total_steps(self) -> int:
        t = self.cfg.trainer
        total = self.train_data.num_batches(t.train_batch_size) * t.epochs
        return min(total, t.max_steps) if t.max_steps is not None else total

    def _max_gen_len(self) -> int:
        return max_generate_length(self.cfg)

    def _maybe_resume(self) -> bool:
        """Load the checkpoint `resume_mode` asks for, if any, and push its weights to the engines."""
        t = self.cfg.trainer
        mode = (t.resume_mode or "none").lower()
        if mode == "none":
            return False
        path = (
            Path(t.resume_path).expanduser()
            if mode == "from_path" and t.resume_path
            else (ckpt.latest_checkpoint(self.paths.ckpt))
        )
        if path is None:
            return False
        assert self.policy is not None
        self.state = ckpt.load_trainer_state(path)
        self.policy.call_all("load_checkpoint", str(path / "policy"))
        if self.critic is not None:
            self.critic.call_all("load_checkpoint", str(path / "critic"))
        self._sync_weights()
        self._say(f"resumed from {path} (step {self.state.global_step})")
        return True

    # ================================================================== one step
    def _train_critic(self, batch: SequenceBatch) -> dict[str, float]:
        """Fit the critic to this batch's GAE returns, one optimizer step per critic mini-batch."""
        assert self.critic is not None
        t = self.cfg.trainer
        rows_per_mini = t.critic_mini_batch_size * self.cfg.generator.n_samples_per_prompt
        sums: dict[str, list[float]] = defaultdict(list)
        for _ in range(t.update_epochs_per_batch):
            for start in range(0, batch.batch_size, rows_per_mini):
                mini = batch.select(list(range(start, min(start + rows_per_mini, batch.batch_size))))
                objective = ValueObjective(
                    value_clip=t.algorithm.value_clip,
                    token_count=max(1, mini_batch_totals(mini.response_mask).token_count),
                )
                out = self.critic.train_mini_batch(mini, objective, t.micro_train_batch_size_per_gpu, 1.0)
                for k, v in out.items():
                    sums[k].append(v)
        return {f"critic/{k}": statistics.fmean(v) for k, v in sums.items()}

    def _sampling_params(self, evaluation: bool) -> SamplingParams:
        g = self.cfg.generator
        sp = g.eval_sampling_params if evaluation else g.sampling_params
        max_tokens = sp.max_generate_length if evaluation and sp.max_generate_length else self._max_gen_len()
        return SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_tokens=int(max_tokens),
            stop=list(sp.stop) if sp.stop else None,
            logprobs=not evaluation,
        )

    @property
    def train_temperature(self) -> float:
        temp = self.cfg.generator.sampling_params.temperature
        return temp if temp > 0 else 1.0

    def generate(self, rows: list[PromptSample], evaluation: bool = False) -> list[Trajectory]:
        return self.loop.run_until_complete(self._rollout(rows, evaluation))

    def _rollout(self, rows: list[PromptSample], evaluation: bool = False, ahead: int = 0) -> Any:
        """The generation coroutine of the next step's rows (`ahead` steps further for async runs,
        or evaluation); its trajectories record the engines' policy version now."""
        g = self.cfg.generator
        n = g.eval_n_samples_per_prompt if evaluation else g.n_samples_per_prompt
        seeds = None
        if g.seeded_sampling:
            step = -1 if evaluation else self.state.global_step + ahead
            seeds = [rollout_seed(self.cfg.trainer.seed, step, row.uid) for row in rows]
        return self.generator.generate(rows, n, self._sampling_params(evaluation), self.engine_version, seeds)

    def make_batch(self, trajectories: list[Trajectory]) -> SequenceBatch:
        return build_sequence_batch(
            [tr.prompt_ids for tr in trajectories],
            [tr.response_ids for tr in trajectories],
            [tr.loss_mask for tr in trajectories],
            pad_token_id=self.pad_id,
            per_token={"rollout_logprobs": [tr.rollout_logprobs for tr in trajectories]},
        )

    def train_step(self, rows: list[PromptSample]) -> dict[str, float]:
        """One synchronous step: generate, update the policy on the rollouts, sync the weights."""
        tick = time.perf_counter()
        trajectories = self.generate(rows)
        generate_s = time.perf_counter() - tick
        if self.colocation.sleep_engines:  # free the shared devices for training
            self.loop.run_until_complete(self.engines.sleep())  # type: ignore[union-attr]
            self._engines_asleep = True
        metrics = self.update_policy(trajectories)
        metrics.update(self._sync_after_update())
        metrics.update({"timing/generate_s": generate_s, "timing/wait_s": generate_s})
        return metrics

    def async_train_step(
        self, rows: list[PromptSample], next_rows: list[PromptSample] | None
    ) -> dict[str, float]:
        """One step of one-step-off training: `next_rows` are generated while `rows` train."""
        assert self.rollouts is not None
        wait_s = generate_s = 0.0
        if not self.rollouts.pending:  # the first step: nothing was launched ahead
            self.rollouts.launch(self._rollout(rows))
            wait_s, generate_s = self.rollouts.join()
        trajectories = self.rollouts.take()
        if next_rows is not None:
            self.rollouts.launch(self._rollout(next_rows, ahead=1))
        metrics = self.update_policy(trajectories)
        waited, generated = self.rollouts.join()  # no generation may be in flight during the sync
        metrics.update(self._sync_after_update())
        metrics.update({"timing/generate_s": generate_s + generated, "timing/wait_s": wait_s + waited})
        return metrics

    def update_policy(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Rewards -> logprobs -> advantages -> policy (and critic) updates; the version goes up."""
        assert self.policy is not None
        t, alg = self.cfg.trainer, self.cfg.trainer.algorithm
        timings: dict[str, float] = {}
        versions = [tr.policy_version for tr in trajectories]
        check_staleness(self.state.policy_version, versions, t.max_staleness_steps if t.async_training else 0)
        batch = self.make_batch(trajectories)
        rewards = torch.tensor([tr.reward for tr in trajectories], dtype=torch.float32)
        metrics: dict[str, float] = staleness_metrics(self.state.policy_version, versions)

        tick = time.perf_counter()
        n_mini = t.train_batch_size // t.policy_mini_batch_size
        old_source = ppo_old_logprobs_source(
            t.async_training, alg.use_tis, t.update_epochs_per_batch > 1 or n_mini > 1 or alg.use_kl_in_reward
        )
        if old_source == "trainer":
            batch = batch.with_extras(
                old_logprobs=self.policy.compute_logprobs(
                    batch, t.micro_forward_batch_size_per_gpu, self.train_temperature
                )
            )
        elif old_source == "rollout":
            batch = batch.with_extras(old_logprobs=batch.extras["rollout_logprobs"])
        if self.ref is not None:
            batch = batch.with_extras(
                ref_logprobs=self.ref.compute_logprobs(
                    batch, t.micro_forward_batch_size_per_gpu, self.train_temperature
                )
            )
        values = None
        if self.critic is not None:
            values = self.critic.compute_values(batch, t.micro_forward_batch_size_per_gpu)
            batch = batch.with_extras(values=values)
        timings["timing/logprobs_s"] = time.perf_counter() - tick

        token_rewards = sequence_rewards_to_token_level(rewards, batch.response_mask)
        if alg.use_kl_in_reward:
            token_rewards, kl_metrics = apply_kl_penalty(
                token_rewards,
                batch.extras["old_logprobs"],
                batch.extras["ref_logprobs"],
                batch.response_mask,
                alg.kl_loss_coef,
                alg.kl_estimator_type,
            )
            metrics.update({f"kl_in_reward/{k}": v for k, v in kl_metrics.items()})
        advantages, returns = compute_advantages(
            alg.advantage_estimator,
            token_rewards,
            batch.response_mask,
            group_ids=[tr.uid for tr in trajectories],
            values=values,
            gamma=alg.gamma,
            lambd=alg.lambd,
            norm_by_std=alg.grpo_norm_by_std,
        )
        if alg.advantage_batch_normalize:
            advantages = masked_whiten(advantages, batch.response_mask, 1e-6)
        batch = batch.with_extras(advantages=advantages)
        if self.critic is not None:
            tick = time.perf_counter()
            batch = batch.with_extras(returns=returns)
            metrics.update(self._train_critic(batch))
            timings["timing/critic_train_s"] = time.perf_counter() - tick

        tick = time.perf_counter()
        objective = PolicyObjective(
            loss_type=alg.policy_loss_type,
            loss_reduction=alg.loss_reduction,
            loss_config=PolicyLossConfig(
                eps_clip_low=alg.eps_clip_low,
                eps_clip_high=alg.eps_clip_high,
                clip_ratio_c=alg.clip_ratio_c,
                tis_imp_ratio_cap=alg.tis_imp_ratio_cap if alg.use_tis else None,
            ),
            use_kl_loss=alg.use_kl_loss,
            kl_loss_coef=alg.kl_loss_coef,
            kl_estimator=alg.kl_estimator_type,
            max_len=self._max_gen_len(),
        )
        rows_per_mini = t.policy_mini_batch_size * self.cfg.generator.n_samples_per_prompt
        skip_zero = t.skip_zero_advantage_rows and not alg.use_kl_loss
        train_metrics: dict[str, list[float]] = defaultdict(list)
        trained_rows = 0
        for _ in range(t.update_epochs_per_batch):
            for start in range(0, batch.batch_size, rows_per_mini):
                mini = batch.select(list(range(start, min(start + rows_per_mini, batch.batch_size))))
                totals = mini_batch_totals(mini.response_mask)  # of the whole mini-batch, kept rows or not
                step_obj = dataclasses.replace(
                    objective, token_count=max(1, totals.token_count), seq_count=max(1, totals.seq_count)
                )
                if skip_zero:
                    mini = mini.select(
                        rows_with_policy_gradient(
                            mini.extras["advantages"], mini.response_mask, self.policy.world_size
                        )
                    )
                trained_rows += mini.batch_size
                out = self.policy.train_mini_batch(
                    mini, step_obj, t.micro_train_batch_size_per_gpu, self.train_temperature
                )
                for k, v in out.items():
                    train_metrics[k].append(v)
        timings["timing/train_s"] = time.perf_counter() - tick
        metrics["train/rows_trained_frac"] = trained_rows / (batch.batch_size * t.update_epochs_per_batch)
        self.state.policy_version += 1

        lengths = [tr.num_generated_tokens for tr in trajectories]
        metrics.update(
            {
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                "response_length/mean": statistics.fmean(lengths),
                "response_length/max": float(max(lengths)),
                "response/truncated_frac": sum(tr.stop_reason != "stop" for tr in trajectories)
                / len(trajectories),
                "advantages/abs_mean": float(advantages.abs().sum() / batch.response_mask.sum().clamp(min=1)),
            }
        )
        metrics.update({f"policy/{k}": statistics.fmean(v) for k, v in train_metrics.items()})
        # how far the trainer's logprobs of the sampled tokens are from the engine's: measured before
        # any update of this step (later mini-batches see already-updated weights)
        if old_source == "trainer":
            diff = (
                batch.extras["old_logprobs"] - batch.extras["rollout_logprobs"]
            ).abs() * batch.response_mask
            metrics["policy/logprob_diff_vs_rollout"] = float(
                diff.sum() / batch.response_mask.sum().clamp(min=1)
            )
        elif train_metrics.get("logprob_diff_vs_rollout"):
            metrics["policy/logprob_diff_vs_rollout"] = train_metrics["logprob_diff_vs_rollout"][0]
        metrics.update(timings)
        return metrics

    def _sync_after_update(self) -> dict[str, float]:
        """Broadcast the new weights unless async staleness allows the engines to lag behind."""
        t = self.cfg.trainer
        tick = time.perf_counter()
        if needs_weight_sync(
            self.state.policy_version, self.engine_version, t.async_training, t.max_staleness_steps
        ):
            self._sync_weights()
        return {"timing/weight_sync_s": time.perf_counter() - tick}

    @property
    def _engine_weight_dtype(self) -> str | None:
        """The dtype weights are sent in: the engines' (`generator.model_dtype`), None = as trained."""
        dtype = self.cfg.generator.model_dtype
        return None if dtype == "auto" else dtype

    @property
    def _weight_sync_backend(self) -> str | None:
        backend = self.cfg.generator.weight_sync_backend
        return None if backend == "auto" else backend

    def _sync_weights(self) -> None:
        """Push the policy's weights to every live engine.

        Engines that failed since the weight-update group was built are left out of a new group
        first. A failed broadcast probes the engines, rebuilds the group with those that answer
        and retries once. With no engine left nothing is sent: the step still completes (its
        update is applied) and the next generation stops training with a checkpoint.
        """
        assert self.policy is not None and self.engines is not None
        from skylift.weight_sync import WeightSyncError

        if self._engines_asleep:  # colocated on GPU: weights must be resident to be overwritten
            self.loop.run_until_complete(self.engines.wake_up())
            self._engines_asleep = False
        for attempt in (1, 2):
            if self.engines.live_indices != self._sync_members and not self._rebuild_weight_sync():
                return
            try:
                self.policy.call_all("sync_weights", dtype=self._engine_weight_dtype)
                break
            except WeightSyncError as exc:
                if attempt == 2:
                    raise
                self._say(f"weight sync failed ({exc}); checking the engines and retrying once")
                self.loop.run_until_complete(self.engines.probe())
                self._sync_members = []  # force a new group
        self.engine_version = self.state.policy_version

    def _rebuild_weight_sync(self) -> bool:
        """A weight-update group of the live engines only; False when none is left."""
        assert self.policy is not None and self.engines is not None
        live = self.engines.live_indices
        if not live:
            self.policy.call_all("close_weight_sync")
            self._sync_members = []
            return False
        self._say(
            f"rebuilding the weight-update group with {len(live)} live engine(s) of {len(self.engine_refs)}"
        )
        self.policy.call_all(
            "rebuild_weight_sync",
            [self.engine_refs[i] for i in live],
            self._weight_sync_backend,
            self.cfg.generator.weight_sync_timeout_s,
            self.cfg.generator.weight_sync_master_address,
        )
        self._sync_members = live
        return True

    # ================================================================== evaluation
    def evaluate(self) -> dict[str, float]:
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        if self.engine_version != self.state.policy_version:  # async runs may skip syncs
            self._sync_weights()
        tick = time.perf_counter()
        rows = list(self.val_data)
        trajectories: list[Trajectory] = []
        for start in range(0, len(rows), self.cfg.trainer.eval_batch_size):
            trajectories += self.generate(
                rows[start : start + self.cfg.trainer.eval_batch_size], evaluation=True
            )
        by_source: dict[str, list[float]] = defaultdict(list)
        for tr in trajectories:
            by_source[tr.data_source or "all"].append(tr.reward)
        metrics = {f"eval/{src}/accuracy": statistics.fmean(v) for src, v in by_source.items()}
        metrics["eval/accuracy"] = statistics.fmean(tr.reward for tr in trajectories)
        metrics["eval/response_length"] = statistics.fmean(tr.num_generated_tokens for tr in trajectories)
        metrics["timing/eval_s"] = time.perf_counter() - tick
        if self.cfg.trainer.dump_eval_results:
            self._dump_eval(trajectories)
        return metrics

    def _dump_eval(self, trajectories: list[Trajectory]) -> None:
        import json

        path = self.paths.logs / "eval" / f"step_{self.state.global_step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for tr in trajectories:
                f.write(
                    json.dumps(
                        {
                            "uid": tr.uid,
                            "response": tr.response_text,
                            "reward": tr.reward,
                            "stop_reason": tr.stop_reason,
                        }
                    )
                    + "\n"
                )

    # ================================================================== checkpoints
    def save_checkpoint(self) -> Path:
        assert self.policy is not None
        step = self.state.global_step
        tmp = ckpt.begin_checkpoint(self.paths.ckpt, step)
        self.policy.call_all("save_checkpoint", str(tmp / "policy"))
        if self.critic is not None:
            self.critic.call_all("save_checkpoint", str(tmp / "critic"))
        return ckpt.commit_checkpoint(self.paths.ckpt, step, self.state, self.cfg.trainer.max_ckpts_to_keep)

    def export(self) -> str:
        assert self.policy is not None
        target = self.paths.export / f"global_step_{self.state.global_step}"
        return str(self.policy.call_all("export_hf", str(target))[0])

    # ================================================================== the loop
    def fit(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        t = self.cfg.trainer
        total_steps = self._total_steps()
        if t.eval_before_train and self.state.global_step == 0:
            metrics = self.evaluate()
            if metrics:
                self._log(metrics)
                self._say(f"step 0 | eval accuracy {metrics['eval/accuracy']:.3f}")
        start_epoch, start_step = self.train_data.locate(self.state.global_step, t.train_batch_size)
        bar = tqdm(
            total=total_steps,
            initial=self.state.global_step,
            desc="training",
            unit="step",
            disable=not self.console,
            dynamic_ncols=True,
        )
        batches = self.train_data.iter_training(
            t.train_batch_size, t.seed, t.epochs, start_epoch=start_epoch, start_step=start_step
        )
        if t.async_training:
            self.rollouts = BackgroundRollouts(self.loop)
        try:
            self._fit_steps(with_next(batches), total_steps, bar)
        except EngineUnavailableError as exc:
            raise self._stop_after_engine_loss(exc) from exc
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
                self.rollouts = None
        bar.close()
        return self.history

    def _fit_steps(self, batches: Any, total_steps: int, bar: Any) -> None:
        t = self.cfg.trainer
        for (epoch, step_in_epoch, rows), upcoming in batches:
            if self.state.global_step >= total_steps:
                break
            tick = time.perf_counter()
            if t.async_training:
                last = upcoming is None or self.state.global_step + 1 >= total_steps
                metrics = self.async_train_step(rows, None if last else upcoming[2])
            else:
                metrics = self.train_step(rows)
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
            if self.engines is not None and self.engines.failures:
                metrics["engines/live"] = float(len(self.engines.live_indices))
            metrics["timing/step_s"] = time.perf_counter() - tick
            # engines idle: the step's time with no generation running (evaluation counts as busy)
            busy = metrics["timing/generate_s"] + metrics.get("timing/eval_s", 0.0)
            metrics["timing/idle_s"] = max(0.0, metrics["timing/step_s"] - busy)
            self._log(metrics)
            bar.update(1)
            if self.console:
                bar.write(self._summary(step, total_steps, metrics))

    def _stop_after_engine_loss(self, exc: EngineUnavailableError) -> TrainingStoppedError:
        """Save the last completed step (engines fail in generation, before a step changes the
        policy, or in a sync after it counted) and explain how to continue."""
        step = self.state.global_step
        what = "all inference engines failed" if isinstance(exc, NoHealthyEngineError) else "an engine failed"
        if step == 0:
            saved = "nothing to save: no step had completed"
        elif (
            latest := ckpt.latest_checkpoint(self.paths.ckpt)
        ) is not None and latest.name == f"global_step_{step}":
            saved = f"step {step} was already checkpointed at {latest}"
        else:
            saved = f"saved step {step} to {self.save_checkpoint()}"
        self._say(f"stopping: {what} during step {step + 1}; {saved}")
        return TrainingStoppedError(
            f"training stopped during step {step + 1}: {exc}. {saved.capitalize()}. Bring the engines "
            "back and rerun the same command with trainer.resume_mode=latest to continue."
        )

    def _log(self, metrics: dict[str, float]) -> None:
        self.tracking.log(metrics, self.state.global_step)
        self.history.append({"step": self.state.global_step, **metrics})

    @staticmethod
    def _summary(step: int, total: int, m: dict[str, float]) -> str:
        parts = [f"step {step}/{total}", f"reward {m['reward/mean']:.3f}"]
        if "eval/accuracy" in m:
            parts.append(f"eval acc {m['eval/accuracy']:.3f}")
        parts.append(f"resp len {m['response_length/mean']:.1f}")
        if "policy/kl_loss" in m:
            parts.append(f"kl {m['policy/kl_loss']:.4f}")
        if "policy/logprob_diff_vs_rollout" in m:
            parts.append(f"|lp diff| {m['policy/logprob_diff_vs_rollout']:.1e}")
        if "engines/live" in m:
            parts.append(f"engines live {m['engines/live']:.0f}")
        if m.get("async/staleness_max", 0.0) > 0:
            parts.append(f"staleness {m['async/staleness_max']:.0f}")
        parts.append(
            f"gen {m['timing/generate_s']:.1f}s wait {m['timing/wait_s']:.1f}s train {m['timing/train_s']:.1f}s "
            f"sync {m['timing/weight_sync_s']:.1f}s idle {m['timing/idle_s']:.1f}s"
        )
        return " | ".join(parts)

    def _say(self, text: str) -> None:
        if self.console:
            print(f"[skylift] {text}", flush=True)

    def shutdown(self) -> None:
        try:
            if self.policy is not None:
                self.policy.shutdown()
            if self.ref is not None:
                self.ref.shutdown()
            if self.critic is not None:
                self.critic.shutdown()
            if self.engines is not None:
                self.loop.run_until_complete(self.engines.close())
            from skylift.inference.http_session import close_default_pool

            self.loop.run_until_complete(close_default_pool())  # remote engines' pooled HTTP session
        finally:
            if hasattr(self, "tracking"):
                self.tracking.close()
            if self.placement is not None:
                self.placement.remove()
            if self._ray_started:
                import ray

                ray.shutdown()
            self.loop.close()
