"""Patch: vLLM's log of a dead engine core is one line, not a traceback.

When an engine core process dies (killed, crashed), `AsyncLLM`'s output handler logs
"AsyncLLM output_handler failed." with the traceback of its own wait, ending in `EngineDeadError`
("see stack trace above"): it says nothing the error does not, and reached a training run's
console as a wall from each engine actor. `install` filters vLLM's `AsyncLLM` logger so that this
record (and only it: any other error keeps its traceback) is one line. Each call waiting on the
engine fails naming it (`skylift.inference.local`).

Upstream: no issue filed; vLLM 0.32 logs the output handler's every failure with
`logger.exception`. Removable when vLLM logs a dead core without the traceback (kill an engine's
`VLLM::EngineCore` and look at the log).
"""

from __future__ import annotations

import logging

from skylift.inference.vllm_patches.versions import guard

NAME = "quiet_dead_core"
WRITTEN_FOR = "==0.32.*"
#: the logger of vLLM's `AsyncLLM` (its output handler)
LOGGER = "vllm.v1.engine.async_llm"


class DeadCoreLine(logging.Filter):
    """A record carrying `EngineDeadError` becomes its message and one sentence, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        if record.exc_info and isinstance(record.exc_info[1], EngineDeadError):
            record.msg = f"{record.getMessage()} The engine core process died (EngineDeadError)"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


FILTER = DeadCoreLine()


def install() -> None:
    """Filter vLLM's `AsyncLLM` logger (idempotent); `VllmPatchVersionError` on a vLLM it does not fit."""
    guard(NAME, WRITTEN_FOR)
    log = logging.getLogger(LOGGER)
    if FILTER not in log.filters:
        log.addFilter(FILTER)
