"""The weights `skylift eval --checkpoint PATH` evaluates, and how they reach the engines.

PATH is one of:
- a trainer checkpoint, `<ckpt_path>/global_step_N` (`skylift.rl.checkpoint`: `policy/` sharded
  by torch.distributed.checkpoint, `trainer_state.json`, the `COMPLETE` marker), or the checkpoint
  directory holding them (its latest complete one). It is loaded the way resume loads it
  (`load_checkpoint` of a policy rank built from the run's `trainer.policy.model.path`, LoRA
  settings included, which refuses a checkpoint of another model);
- a Hugging Face model directory (`config.json` and weights), e.g. `<export_path>/global_step_N`,
  whose architecture must be the configured model's.

Remote engines (`skylift serve` servers) receive the weights through the training run's weight
sync (`EngineWeights`: the weight-update group, a full-weight broadcast or the LoRA adapter).
Local engines start on a Hugging Face directory: the export itself, or the checkpoint converted
by the same rank's `export_hf` (what `skylift train` exports) into `<run>/eval_exports/`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from skylift.config import ConfigError
from skylift.config.schema import SkyliftConfig
from skylift.rl import checkpoint as ckpt

FLAG = "--checkpoint"
#: the config.json fields that fix the shapes of a model's weights
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
_STEP = re.compile(r"^global_step_(\d+)(\.partial)?$")


@dataclass(frozen=True)
class EvalWeights:
    """Resolved `--checkpoint`: a trainer checkpoint's step directory or a Hugging Face directory."""

    kind: Literal["checkpoint", "hf"]
    path: Path
    global_step: int | None = None  # the training steps behind the weights, when known
    policy_version: int = 0  # the version the engines label their samples with

    def describe(self) -> str:
        what = "trainer checkpoint" if self.kind == "checkpoint" else "Hugging Face directory"
        step = f" (step {self.global_step})" if self.global_step is not None else ""
        return f"{what} {self.path}{step}"


def _is_hf_dir(path: Path) -> bool:
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    return (path / "config.json").is_file() and bool(weights)


def _step_of(path: Path) -> int | None:
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


def architecture_mismatch(hf_dir: Path, model: str) -> str | None:
    """None when the Hugging Face directory `hf_dir` has the architecture of the configured model
    `model` (compared on `ARCHITECTURE_KEYS` of their config.json; a Hub id is not compared),
    else a message naming the fields that differ."""
    from skylift.models import resolve_model_path

    base = Path(resolve_model_path(model)) / "config.json"
    if not base.is_file():
        return None
    theirs, ours = json.loads((hf_dir / "config.json").read_text()), json.loads(base.read_text())
    differ = [
        f"{k} {theirs.get(k)} (the model's: {ours.get(k)})"
        for k in ARCHITECTURE_KEYS
        if theirs.get(k) != ours.get(k)
    ]
    if not differ:
        return None
    return (
        f"{hf_dir} is not a model of the configured architecture (trainer.policy.model.path={model}): "
        + ", ".join(differ)
    )


def resolve_eval_weights(path: str | Path, model: str) -> EvalWeights:
    """What `path` holds (see the module's docstring); `model`: `trainer.policy.model.path`.
    Raises `ConfigError` saying what was expected for anything else."""
    given = Path(path).expanduser()
    if not given.exists():
        raise ConfigError(f"{FLAG} {given}: no such file or directory")
    if _is_hf_dir(given):
        problem = architecture_mismatch(given, model)
        if problem:
            raise ConfigError(f"{FLAG}: {problem}")
        return EvalWeights("hf", given, _step_of(given))
    if given.is_dir() and ((given / "policy").is_dir() or _STEP.match(given.name)):
        if not (given / ckpt.COMPLETE_MARKER).is_file():
            latest = ckpt.latest_checkpoint(given.parent)
            hint = f"; the latest complete one is {latest}" if latest else ""
            raise ConfigError(
                f"{FLAG} {given}: an incomplete trainer checkpoint (no {ckpt.COMPLETE_MARKER} marker: "
                f"the run stopped while writing it){hint}"
            )
        if not (given / "policy").is_dir():
            raise ConfigError(f"{FLAG} {given}: a trainer checkpoint without the policy's weights (policy/)")
        state = ckpt.load_trainer_state(given)
        return EvalWeights("checkpoint", given, state.global_step, state.policy_version)
    if given.is_dir() and (latest := ckpt.latest_checkpoint(given)) is not None:
        return resolve_eval_weights(latest, model)
    raise ConfigError(
        f"{FLAG} {given}: neither a trainer checkpoint (<ckpt_path>/global_step_N holding policy/ and "
        f"{ckpt.COMPLETE_MARKER}, or the directory of them) nor a Hugging Face model directory "
        "(config.json and *.safetensors, e.g. <export_path>/global_step_N)"
    )


def frozen_policy(cfg: SkyliftConfig, weights: EvalWeights) -> Any:
    """One in-process policy rank holding `weights` (a `WorkerGroup`, set up): the run's policy
    settings over `trainer.policy.model.path` with the checkpoint loaded as resume loads it, or
    over the Hugging Face directory (LoRA merged there: no adapter). No optimizer."""
    from skylift.cluster.frozen_policy import frozen_policy_group

    if weights.kind == "hf":
        return frozen_policy_group(cfg, str(weights.path), None)
    return frozen_policy_group(cfg, None, str(weights.path / "policy"))


def push_to_engines(
    cfg: SkyliftConfig, weights: EvalWeights, engines: Any, run: Callable, say: Callable[[str], None]
) -> None:
    """Put `weights` into the (remote) engines of `engines` (an `EnginePool`) with a training
    run's weight sync: a weight-update group from the policy rank, one sync, the group closed."""
    from skylift.cluster.engine_weights import EngineWeights

    group = frozen_policy(cfg, weights)
    try:
        sync = EngineWeights(cfg, group, engines, run, say)
        sync.open()
        try:
            sync.sync(weights.policy_version)
        finally:
            sync.close()
    finally:
        group.shutdown()


def export_for_engines(cfg: SkyliftConfig, weights: EvalWeights, directory: Path) -> Path:
    """A Hugging Face directory of `weights` for local engines to start on: the export itself, or
    the checkpoint written by the policy rank's `export_hf` into `directory`."""
    if weights.kind == "hf":
        return weights.path
    group = frozen_policy(cfg, weights)
    try:
        return Path(group.export_hf(str(directory)))
    finally:
        group.shutdown()
