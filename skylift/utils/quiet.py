"""What the libraries under skylift print during a run: errors only, unless asked for more.

vLLM, PyTorch (its C++ core and c10d), transformers and Ray each have their own switch for their
messages; `quiet_libraries()` sets them as environment defaults before those libraries are
imported, so the run's own processes (this one, Ray workers, vLLM's engine core and workers)
start with them. A variable the user set wins (e.g. `VLLM_LOGGING_LEVEL=INFO skylift train ...`),
and `verbose=True` (`--verbose`) sets nothing: every library prints what it prints by default.
"""

from __future__ import annotations

import os
import warnings

QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # engine start-up notes, deprecation warnings
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10d's "hostname of the client socket cannot be retrieved"
    "TORCH_LOGS": "-torch",  # torch's Python loggers ("Triton not available")
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bar at every model load
    "RAY_LOGGER_LEVEL": "error",  # Ray's driver-side start-up lines
    # libraries' deprecation notices to their developers; multiprocessing's note at exit about
    # vLLM's shared-memory segments; torch.distributed.checkpoint's note that a worker alone (one
    # rank, no process group) saves or loads its checkpoint in a single process, as it should
    "PYTHONWARNINGS": (
        "ignore::FutureWarning,ignore:resource_tracker:UserWarning,"
        "ignore:torch.distributed is disabled:UserWarning"
    ),
}


def quiet_libraries(verbose: bool = False) -> None:
    """Set `QUIET_ENV` as defaults for this process and the ones it starts (no-op when `verbose`).

    Call it before torch or vLLM is imported: PyTorch reads its C++ log level when it loads.
    """
    if verbose:
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if os.environ["PYTHONWARNINGS"] == QUIET_ENV["PYTHONWARNINGS"]:  # this interpreter read it at start
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message="resource_tracker", category=UserWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
