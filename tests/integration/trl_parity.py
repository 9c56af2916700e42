"""What the TRL parity tests (SFT, DPO, reward model) set the same way on TRL's side: fp32 on CPU,
a constant learning rate of 1e-3 without decay or warm-up, clipping at 1, rows in order, seed 42,
nothing saved or reported; and a trainer that records each step's loss."""

from __future__ import annotations

from typing import Any

TRL_CPU_FP32: dict[str, Any] = {
    "learning_rate": 1e-3,
    "weight_decay": 0.0,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "max_grad_norm": 1.0,
    "train_sampling_strategy": "sequential",
    "use_cpu": True,
    "bf16": False,  # TRL turns bf16 autocast on by default; fp32 on both sides
    "report_to": [],
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 42,
    "gradient_checkpointing": False,
}


def trl_args(config_cls: type, output_dir: str, **settings: Any) -> Any:
    """`config_cls` (TRL's SFTConfig, DPOConfig, RewardConfig) with `TRL_CPU_FP32`, the model
    loaded in fp32, and the test's own `settings`."""
    import torch

    return config_cls(
        output_dir=output_dir, model_init_kwargs={"dtype": torch.float32}, **TRL_CPU_FP32, **settings
    )


def recording(trainer_cls: type, recorded: list[float]) -> type:
    """`trainer_cls` whose every loss computation appends the loss to `recorded`."""

    class Recording(trainer_cls):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            recorded.append(float((out[0] if isinstance(out, tuple) else out).detach()))
            return out

    return Recording
