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
from skylift.utils.engine_errors import EngineStartError
from skylift.utils.memory_errors import out_of_memory_line
from skylift.utils.messages import one_line, said

#: what to change when a training worker runs out of memory (the keys of `skylift train`)
OUT_OF_MEMORY_ADVICE = (
    "To fit, lower trainer.micro_train_batch_size_per_gpu or trainer.micro_forward_batch_size_per_gpu "
    "(or set trainer.max_tokens_per_microbatch), keep trainer.gradient_checkpointing=true, shorten "
    "generator.max_generate_length, or move state to host memory "
    "(trainer.policy.fsdp_config.cpu_offload=true); with colocate_all, lower "
    "generator.gpu_memory_utilization (docs/gpu.md). Rerun with trainer.resume_mode=latest to continue "
    "from the last checkpoint"
)


class Trainer(Protocol):
    def setup(self) -> None: ...

    def shutdown(self) -> None: ...


T = TypeVar("T", bound=Trainer)


def run_trainer(build: Callable[[], T], work: Callable[[T], None], prog: str, verbose: bool = False) -> int:
    """Build a trainer, set it up, run `work` on it and shut it down whatever happens. The exit code:
    0 done, 2 a configuration error only the run's machine can judge (e.g. the engine's device), a
    placement the cluster cannot hold or a colocation that leaves the engines too little (`PlacementError`,
    `ColocationError`: the line `skylift train --dry-run --gpus` gives), an engine that did not start (`EngineStartError`: its cause, most often memory) or a model whose
    weights do not map to its checkpoint's names (`UnmappedWeightError`, at the first weight
    sync), 3 training stopped (`TrainingStoppedError`, e.g. every engine lost), 4 a rollout
    failed on the user's input (`rollout_input`: a dataset row the chat template cannot render
    or longer than `generator.max_prompt_length`, an environment that raised or returned a reward
    that is not a number, a request the engine refused with its limit, images for a text-only
    policy; training saves its last completed step first: `RolloutInputStoppedError`), 5 a device or
    host allocation failed (`torch.OutOfMemoryError`, the CPU allocator's error; what to change
    follows; nothing is saved: the step that failed may have changed part of the state); each said on
    one line on stderr after `prog`, the traceback before it when `verbose`. Any other error keeps
    its traceback (a bug, not the user's input)."""
    trainer = None
    try:
        trainer = build()
        trainer.setup()
        work(trainer)
    except (ConfigError, ModelPathError) as exc:
        return said(prog, f"configuration error: {exc}", exc, 2, verbose)
    except (PlacementError, ColocationError) as exc:  # the cluster cannot hold the run as asked
        return said(prog, str(exc), exc, 2, verbose)
    except (UnmappedWeightError, EngineStartError) as exc:  # perhaps from a Ray actor: the cause's text
        return said(prog, one_line(str(getattr(exc, "cause", None) or exc)), exc, 2, verbose)
    except RolloutInputStoppedError as exc:
        return said(prog, str(exc), exc, 4, verbose)
    except TrainingStoppedError as exc:
        return said(prog, str(exc), exc, 3, verbose)
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
