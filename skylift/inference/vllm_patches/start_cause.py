"""Workaround: an engine that fails to start tells the process that started it why.

vLLM 0.32 starts its engine core, and its workers, in child processes. When one of them fails
during start-up (most often memory: "No available memory for the cache blocks", "Free memory on
device ... is less than desired GPU memory utilization", a KV cache too small for
``max_model_len``), the child logs the cause and exits, and the starting process only gets
``RuntimeError: Engine core initialization failed. See root cause above.``: a run stopped after a
page of child tracebacks whose last line does not say what was wrong.

What skylift does: `recording` (in the starting process, around ``AsyncLLM.from_engine_args``)
names a file in the environment its children inherit; `install`, a vLLM general plugin (the
``vllm.general_plugins`` entry point in pyproject.toml, which vLLM loads in its engine core before
it builds the executor and in each worker before it sets up the device), adds a handler to vLLM's
logger that writes the first error logged with an exception into that file, as one line. The
starting process reads it (`LocalVLLMEngine.create`: `EngineStartError`). Nothing is written
outside such a start (the variable is unset), and vLLM's own logging is left as it is.

Upstream: vLLM's start-up handshake carries no failure reason (``wait_for_engine_startup``).
Removable when the starting process's error names the child's cause (start an engine with
``generator.kv_cache_gb=0.000001`` and read the last line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from skylift.inference.vllm_patches.versions import guard

NAME = "start_cause"
WRITTEN_FOR = "==0.32.*"
#: the file a failing engine child writes its cause to (set only while a start is awaited)
CAUSE_ENV = "SKYLIFT_ENGINE_START_CAUSE"
#: the longest cause kept (vLLM's memory messages are a few hundred characters)
MAX_CAUSE_CHARS = 2000


class _CauseHandler(logging.Handler):
    """Writes the first exception logged at ERROR or above to the file `CAUSE_ENV` names."""

    _skylift_start_cause = True

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        path = os.environ.get(CAUSE_ENV)
        if not path or not record.exc_info or record.exc_info[1] is None:
            return
        try:
            write_cause(Path(path), describe(record.exc_info[1]))
        except Exception:  # noqa: BLE001 - a failing engine must fail with vLLM's own error
            self.handleError(record)


def describe(exc: BaseException) -> str:
    """`Type: message` of `exc`, on one line, at most `MAX_CAUSE_CHARS` long."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 3] + "..."


def write_cause(path: Path, cause: str) -> None:
    """Write `cause` to `path` unless a cause is there already (the first failure is the root: a
    worker's, before the engine core's report that a worker failed)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(cause)


def install() -> None:
    """Add the cause handler to vLLM's logger (idempotent). vLLM calls this in each of its
    processes (a general plugin); it writes only where `CAUSE_ENV` is set.
    `VllmPatchVersionError` on a vLLM it was not written for (vLLM logs a plugin's failure and
    goes on)."""
    guard(NAME, WRITTEN_FOR)
    logger = logging.getLogger("vllm")
    if not any(getattr(h, "_skylift_start_cause", False) for h in logger.handlers):
        logger.addHandler(_CauseHandler())


@contextlib.contextmanager
def recording() -> Iterator[Path]:
    """While inside, engine processes started from here write a start-up failure's cause to the
    yielded path (absent: none was logged). Engines start one at a time in a process (vLLM's
    start-up blocks), so one variable serves."""
    with tempfile.TemporaryDirectory(prefix="skylift-engine-start-") as folder:
        path = Path(folder) / "cause"
        before = os.environ.get(CAUSE_ENV)
        os.environ[CAUSE_ENV] = str(path)
        try:
            yield path
        finally:
            if before is None:
                os.environ.pop(CAUSE_ENV, None)
            else:
                os.environ[CAUSE_ENV] = before


def read_cause(path: Path) -> str | None:
    """The cause a failing engine process wrote to `path`, if any."""
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
