"""Running a trainer to the end from a command: set-up, the work, shutdown, and the exit code."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol, TypeVar

from skylift.config import ConfigError
from skylift.models import ModelPathError
from skylift.models.checkpoint_names import UnmappedWeightError
from skylift.rl.loop import TrainingStoppedError
from skylift.utils.messages import one_line


class Trainer(Protocol):
    def setup(self) -> None: ...

    def shutdown(self) -> None: ...


T = TypeVar("T", bound=Trainer)


def run_trainer(build: Callable[[], T], work: Callable[[T], None], prog: str) -> int:
    """Build a trainer, set it up, run `work` on it and shut it down whatever happens. The exit code:
    0 done, 2 a configuration error only the run's machine can judge (e.g. the engine's device) or a
    model whose weights do not map to its checkpoint's names (`UnmappedWeightError`, at the first
    weight sync), 3 training stopped (`TrainingStoppedError`); each said on one line on stderr
    after `prog`."""
    trainer = None
    try:
        trainer = build()
        trainer.setup()
        work(trainer)
    except (ConfigError, ModelPathError) as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return 2
    except UnmappedWeightError as exc:  # from a Ray worker: the cause's text, without the traceback
        print(f"{prog}: {one_line(str(getattr(exc, 'cause', None) or exc))}", file=sys.stderr)
        return 2
    except TrainingStoppedError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 3
    finally:
        if trainer is not None:
            trainer.shutdown()
    return 0
