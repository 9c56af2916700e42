"""Running a trainer to the end from a command: set-up, the work, shutdown, and the exit code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from skylift.cluster.colocation import ColocationError
from skylift.cluster.placement import PlacementError
from skylift.config import ConfigError
from skylift.generator.rollout_errors import rollout_input
from skylift.models import ModelPathError
from skylift.models.checkpoint_names import UnmappedWeightError
from skylift.rl.loop import RolloutInputStoppedError, TrainingStoppedError
from skylift.utils.engine_errors import EngineStartError, EngineUnavailableError
from skylift.utils.memory_errors import out_of_memory_line
from skylift.utils.messages import one_line, said
from skylift.weight_sync.process_group import WeightSyncError

#: what to change when a training worker runs out of memory (the keys of `skylift train`)
OUT_OF_MEMORY_ADVICE = (
    "To fit, lower trainer.micro_train_batch_size_per_gpu or trainer.micro_forward_batch_size_per_gpu "
    "(or set trainer.max_tokens_per_microbatch), keep trainer.gradient_checkpointing=true, shorten "
    "generator.max_generate_length, or move state to host memory "
    "(trainer.policy.fsdp_config.cpu_offload=true); where engines share the trainer's GPU "
    "(colocate_all, local placement), lower generator.gpu_memory_utilization (docs/gpu.md). Rerun with trainer.resume_mode=latest to continue "
    "from the last checkpoint"
)


class Trainer(Protocol):
    def setup(self) -> None: ...

    def shutdown(self) -> None: ...


T = TypeVar("T", bound=Trainer)


def run_trainer(build: Callable[[], T], work: Callable[[T], None], prog: str, verbose: bool = False) -> int:
    """Build a trainer, set it up, run `work` on it and shut it down whatever happens. The exit code:
    0 done, 2 a configuration error only the run's machine can judge (e.g. the engine's device, a
    GPU too small for the engines beside the trainer: `ColocationError`; a placement the cluster
    cannot hold: `PlacementError`), an
    engine that did not start (`EngineStartError`: its cause, most often memory) or a model whose
    weights do not map to its checkpoint's names (`UnmappedWeightError`, at the first weight
    sync), 3 training stopped (`TrainingStoppedError`, e.g. every engine lost; or an engine lost
    or a weight-update group that failed outside training's loop, e.g. while the run set up:
    `EngineUnavailableError`, `WeightSyncError`, with nothing saved), 4 a rollout
    failed on the user's input (`rollout_input`: a dataset row the chat template cannot render
    or longer than `generator.max_prompt_length`, an environment that raised or returned a reward
    that is not a number, a request the engine refused with its limit, images for a text-only
    policy; training saves its last completed step first: `RolloutInputStoppedError`), 5 a device or
    host allocation failed (`torch.OutOfMemoryError`, the CPU allocator's error; what to change
    follows; nothing is saved: the step that failed may have changed part of the state); each said on
    one line on stderr after `prog`, the traceback before it when `verbose`. Any other error keeps
    its traceback (a bug, not the user's input)."""
    trainer, phase = None, "setting up"
    try:
        trainer = build()
        trainer.setup()
        phase = "running"
        work(trainer)
    except (ConfigError, ModelPathError) as exc:
        return said(prog, f"configuration error: {exc}", exc, 2, verbose)
    except ColocationError as exc:  # the engines' share of a GPU the trainer also holds
        return said(prog, f"the engines and the trainer do not fit on one GPU: {exc}", exc, 2, verbose)
    except PlacementError as exc:  # what the placement asks and what the cluster has
        return said(prog, f"placement: {exc}", exc, 2, verbose)
    except (UnmappedWeightError, EngineStartError) as exc:  # perhaps from a Ray actor: the cause's text
        return said(prog, one_line(str(getattr(exc, "cause", None) or exc)), exc, 2, verbose)
    except RolloutInputStoppedError as exc:
        return said(prog, str(exc), exc, 4, verbose)
    except TrainingStoppedError as exc:
        return said(prog, str(exc), exc, 3, verbose)
    except (EngineUnavailableError, WeightSyncError) as exc:  # training's loop says TrainingStoppedError
        return said(prog, engine_lost(exc, phase), exc, 3, verbose)
    except Exception as exc:  # a rollout outside training's loop (`skylift eval`): nothing to save
        if (memory := out_of_memory_line(exc, OUT_OF_MEMORY_ADVICE)) is not None:
            return said(prog, memory, exc, 5, verbose)
        if (line := rollout_input(exc)) is None:
            raise  # not the user's input: a bug, its traceback kept
        return said(prog, f"rollout failed: {line} (--verbose shows the traceback)", exc, 4, verbose)
    finally:
        if trainer is not None:
            trainer.shutdown()
    return 0


def engine_lost(exc: BaseException, phase: str) -> str:
    """The line of an engine (or the weight-update group with it) that failed outside training's
    loop, e.g. while the run set up its weight sync: nothing was saved."""
    return (
        f"stopped while {phase}: {one_line(str(exc))}. Nothing was saved; rerun the same command once "
        "the engines are back (--verbose shows the traceback)"
    )
