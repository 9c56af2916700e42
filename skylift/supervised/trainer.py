"""The supervised fine-tuning loop of `skylift sft`, on the RL trainer's worker groups.

`SupervisedTrainer` starts one `WorkerGroup` of `SupervisedWorker` ranks (Ray actors, or one rank
in this process), then for each step takes the step's rows (`skylift.supervised.data`), shards them
over the ranks and has each take the optimizer step on the step's token-mean loss
(`SupervisedObjective`). It prints one progress line per step, logs to the trackers, reports the
eval datasets' loss every ``eval_interval`` steps, checkpoints (`skylift.rl.checkpoint`'s layout:
the batches of a resumed run are those the interrupted run would have seen) and exports a Hugging
Face model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from skylift.cluster.run_paths import RunPaths
from skylift.cluster.worker_group import WorkerGroup
from skylift.config.sft import SFTConfig
from skylift.rl.checkpoint import (
    TrainerState,
    begin_checkpoint,
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
)
from skylift.supervised.build import eval_sources, total_steps, train_sources, worker_settings
from skylift.supervised.data import StepBatches, loss_tokens, sequence_batch
from skylift.supervised.objective import SupervisedObjective
from skylift.supervised.tokens import TokenizedRow
from skylift.worker.supervised import SupervisedWorker


def _print(line: str) -> None:
    print(line, flush=True)


def check_enough_gpus(world: int, gpus: float) -> None:
    """Refuse (`PlacementError`, one line) more GPU ranks than the Ray cluster has GPUs: each rank's
    actor takes one, and Ray would keep the others waiting until `worker_timeout_s` ran out."""
    from skylift.cluster.placement import PlacementError

    if gpus < world:
        raise PlacementError(
            f"{world} training rank(s) (placement.num_nodes x placement.num_gpus_per_node) need a GPU each, "
            f"and the Ray cluster has {gpus:g}: lower placement.num_gpus_per_node (or join a cluster with more "
            "GPUs: RAY_ADDRESS)"
        )


class SupervisedTrainer:
    """One supervised run (see the module docstring). `run()` returns the per-step losses."""

    #: the ranks' class (a subclass trains another model: `skylift.supervised.reward`)
    worker_cls: type[SupervisedWorker] = SupervisedWorker

    def __init__(self, cfg: SFTConfig, say: Callable[[str], None] = _print) -> None:
        from transformers import AutoTokenizer

        from skylift.models import resolve_model_path

        self.cfg = cfg
        self.say = say
        self.paths = RunPaths.of(cfg.run_name, cfg.runs_dir, cfg.ckpt_path, cfg.export_path, cfg.log_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.batches = StepBatches(
            self.load_train(), cfg.batch_size, cfg.seed, cfg.shuffle, cfg.train_dataset_weights
        )
        self.eval_data = self.load_eval()
        self.total_steps = total_steps(cfg, self.batches.steps_per_epoch)
        self.group: WorkerGroup | None = None
        self.rank_setups: list[dict[str, Any]] = []
        self.tracking: Any = None
        self._ray_started = False
        self.use_ray = False
        self.losses: list[float] = []

    def load_train(self) -> list[list[Any]]:
        """The train rows, one list per dataset (a subclass reads other rows: preference pairs)."""
        return train_sources(self.cfg, self.tokenizer, self.say)

    def load_eval(self) -> dict[str, list[Any]]:
        return eval_sources(self.cfg, self.tokenizer, self.say)

    def read_each_source(self, read: Callable[[str, str | None], list[Any]]) -> list[list[Any]]:
        """`read(source, split)` of every train dataset, for a subclass whose rows are not chat
        examples (preference pairs); the splits as `train_sources` reads them."""
        splits = self.cfg.train_dataset_splits or [None] * len(self.cfg.train_datasets)
        return [read(s, sp) for s, sp in zip(self.cfg.train_datasets, splits, strict=True)]

    def read_each_eval_source(self, read: Callable[[str, str | None], list[Any]]) -> dict[str, list[Any]]:
        """`read(source, split)` of every evaluation dataset (split "validation" unless given)."""
        splits = self.cfg.eval_dataset_splits or ["validation"] * len(self.cfg.eval_datasets)
        return {s: read(s, sp) for s, sp in zip(self.cfg.eval_datasets, splits, strict=True)}

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        from skylift.tracking import Tracking

        cfg = self.cfg
        world = cfg.world_size()
        use_ray = cfg.placement.backend == "ray" or (cfg.placement.backend == "auto" and world > 1)
        self.use_ray = use_ray
        if use_ray:
            from skylift.cluster.ray_start import init_ray

            self._ray_started = init_ray(None, min_cpus=world)
            if torch.cuda.is_available():  # a rank's actor asks for a GPU: Ray would queue the rest
                import ray

                check_enough_gpus(world, float(ray.cluster_resources().get("GPU", 0.0)))
        started = time.perf_counter()
        self.group = self.worker_group("sft", trainable=True)
        # each rank's {"params": the model's, "local_params": its shard's} (FSDP2 over several ranks)
        self.rank_setups = self.group.call_all(self.worker_cls.setup)
        where = f"{world} Ray rank(s)" if use_ray else "this process"
        if world > 1:
            shares = sorted({round(r["local_params"] / max(r["params"], 1), 2) for r in self.rank_setups})
            where += f" (FSDP2: {'/'.join(f'{s:.0%}' for s in shares)} of the parameters each)"
        mode = f"LoRA rank {cfg.model.lora.rank}" if cfg.model.lora.rank else "full fine-tuning"
        self.say(
            f"sft '{cfg.run_name}': {cfg.model.path} ({mode}) on {where}, {self.batches.total_rows} rows, "
            f"{self.total_steps} steps of {cfg.batch_size}; ready in {time.perf_counter() - started:.1f} s"
        )
        self.tracking = Tracking(cfg.loggers(), self.paths.logs, cfg.project_name, cfg.run_name)

    def worker_group(self, name: str, trainable: bool) -> WorkerGroup:
        """A group of the run's ranks (`SupervisedWorker`s) on the run's model; `trainable=False`:
        frozen (a reference model)."""
        import dataclasses

        cfg = self.cfg
        settings = worker_settings(cfg, self.total_steps)
        if not trainable:
            settings = dataclasses.replace(settings, trainable=False, lora_rank=0)
        gpu = torch.cuda.is_available()
        return WorkerGroup(
            name,
            settings,
            cfg.world_size(),
            use_ray=self.use_ray,
            num_cpus_per_worker=1 if gpu else 0,
            num_gpus_per_worker=1 if gpu else 0,
            timeout_s=cfg.worker_timeout_s,
            worker_cls=self.worker_cls,
        )

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if self.tracking is not None:
            self.tracking.close()
            self.tracking = None
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False

    def __enter__(self) -> SupervisedTrainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[float]:
        cfg = self.cfg
        step = self._resume()
        if cfg.eval_before_train and step == 0:
            self._evaluate(0)
        while step < self.total_steps:
            metrics = self.train_step(self.batches.rows(step))
            step += 1
            self.losses.append(metrics["loss"])
            self._progress(step, metrics)
            assert self.tracking is not None
            self.tracking.log({f"train/{k}": v for k, v in metrics.items()}, step)
            last = step == self.total_steps
            if self.eval_data and ((cfg.eval_interval and step % cfg.eval_interval == 0) or last):
                self._evaluate(step)
            if cfg.ckpt_interval and (step % cfg.ckpt_interval == 0 or last):
                self.save_checkpoint(step)
            if (cfg.hf_save_interval and step % cfg.hf_save_interval == 0) or last:
                self.export(step)
        return self.losses

    def train_step(self, rows: Sequence[TokenizedRow]) -> dict[str, float]:
        """One optimizer step on `rows` over every rank: the step's loss and the optimizer's figures."""
        group = self._group()
        started = time.perf_counter()
        batch = sequence_batch(rows, self.pad_id)
        count = float(loss_tokens(rows))
        shards = group.shards(batch) if group.world_size > 1 else [batch]
        mb = self.cfg.micro_train_batch_size_per_gpu
        results = group.call_each(
            SupervisedWorker.train_step, [(s, SupervisedObjective(token_count=count), mb) for s in shards]
        )
        nll = sum(r["nll_sum"] for r in results)
        seconds = time.perf_counter() - started
        tokens = sum(len(r.ids) for r in rows)
        return {
            "loss": nll / max(count, 1.0),
            "grad_norm": float(results[0]["grad_norm"]),
            "lr": float(results[0]["lr"]),
            "loss_tokens": count,
            "tokens": float(tokens),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "step_s": seconds,
        }

    def eval_loss(self, rows: Sequence[TokenizedRow]) -> float:
        """Token-mean loss of `rows` (no gradient), in batches of `batch_size` rows."""
        group = self._group()
        nll = count = 0.0
        size = self.cfg.batch_size
        for i in range(0, len(rows), size):
            batch = sequence_batch(rows[i : i + size], self.pad_id)
            shards = (
                group.shards(batch) if group.world_size > 1 and batch.batch_size >= group.world_size else None
            )
            mb = self.cfg.micro_train_batch_size_per_gpu
            if shards is None:
                results = group.call_each(SupervisedWorker.eval_nll, [(batch, mb)] * group.world_size)[:1]
            else:
                results = group.call_each(SupervisedWorker.eval_nll, [(s, mb) for s in shards])
            nll += sum(r[0] for r in results)
            count += sum(r[1] for r in results)
        return nll / max(count, 1.0)

    def _evaluate(self, step: int) -> None:
        losses = {name: self.eval_loss(rows) for name, rows in self.eval_data.items()}
        shown = ", ".join(f"{name} {loss:.4f}" for name, loss in losses.items())
        self.say(f"eval @ step {step}: loss {shown}")
        assert self.tracking is not None
        self.tracking.log({f"eval/{name}/loss": loss for name, loss in losses.items()}, step)

    def _progress(self, step: int, m: dict[str, float]) -> None:
        width = len(str(self.total_steps))
        norm = f"{m['grad_norm']:.3f}" if math.isfinite(m["grad_norm"]) else "nan (step skipped)"
        self.say(
            f"step {step:>{width}}/{self.total_steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | "
            f"grad_norm {norm} | {int(m['loss_tokens'])}/{int(m['tokens'])} tokens trained | "
            f"{m['tokens_per_s']:.0f} tok/s | {m['step_s']:.2f} s"
        )

    # ------------------------------------------------------------------ checkpoints, export
    def save_checkpoint(self, step: int) -> None:
        tmp = begin_checkpoint(self.paths.ckpt, step)
        self._group().save_checkpoint(str(tmp / "policy"))
        state = TrainerState(global_step=step, extra={"losses": list(self.losses)})
        final = commit_checkpoint(self.paths.ckpt, step, state, self.cfg.max_ckpts_to_keep)
        self.say(f"checkpoint: {final}")

    def _resume(self) -> int:
        resume = self.cfg.resume_from
        if not resume:
            return 0
        found = latest_checkpoint(self.paths.ckpt) if resume == "latest" else resume
        if found is None:
            self.say(f"resume_from=latest: no checkpoint under {self.paths.ckpt}; starting at step 0")
            return 0
        state = load_trainer_state(found)
        self._group().load_checkpoint(f"{found}/policy")
        self.losses = list(state.extra.get("losses", []))
        self.say(f"resumed from {found} at step {state.global_step}")
        return state.global_step

    def export(self, step: int) -> str:
        path = self._group().export_hf(str(self.paths.export / f"global_step_{step}"))
        self.say(f"Hugging Face model: {path}")
        return path

    def _group(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError("the trainer is not started: call start() (or use it as a context manager)")
        return self.group


__all__ = ["SupervisedTrainer"]
