"""A Tinker-compatible training service: the official `tinker` SDK trains and samples against it.

`create_app(ServerConfig(...))` builds the FastAPI app; `skylift tinker serve` runs it. Training
runs on `skylift.worker.training_worker.TrainingWorker`s; sampling on lazily started vLLM engines that
training never starts.
"""

from skylift.tinker.app import create_app
from skylift.tinker.service import ServerConfig, TinkerService

__all__ = ["ServerConfig", "TinkerService", "create_app"]
