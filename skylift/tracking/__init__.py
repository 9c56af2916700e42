"""Metric trackers (console, JSONL, tensorboard, wandb) behind one `Tracking` object."""

from skylift.tracking.trackers import Tracking

__all__ = ["Tracking"]
