"""One in-process policy rank with no optimizer, for evaluating saved weights."""

from __future__ import annotations

import dataclasses

from skylift.cluster.settings import model_worker_settings
from skylift.cluster.worker_group import WorkerGroup
from skylift.config.schema import SkyliftConfig


def frozen_policy_group(cfg: SkyliftConfig, hf_dir: str | None, checkpoint: str | None) -> WorkerGroup:
    """A set-up `WorkerGroup` of one untrained rank: the run's policy settings over
    `trainer.policy.model.path` with the sharded `checkpoint` loaded as resume loads it, or over
    the Hugging Face directory `hf_dir` (no adapter: LoRA is merged there)."""
    settings = dataclasses.replace(model_worker_settings(cfg, True, 1), trainable=False)
    if hf_dir is not None:
        settings = dataclasses.replace(settings, model_path=hf_dir, lora_rank=0)
    group = WorkerGroup("eval-policy", settings, 1, use_ray=False, timeout_s=cfg.trainer.worker_timeout_s)
    try:
        group.setup()
        if checkpoint is not None:
            group.load_checkpoint(checkpoint)
    except BaseException:
        group.shutdown()
        raise
    return group
