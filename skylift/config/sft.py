"""The configuration of `skylift sft`: a typed dataclass tree with ``key.sub=value`` overrides.

Flat keys for the data and the schedule (``train_datasets=[...]``, ``batch_size=8``) and the same
groups as `skylift train`'s policy for the model (``model.path``, ``model.lora.*``),
``optimizer_config.*`` and ``fsdp_config.*``. Other projects' spellings (SkyRL's ``main_sft``) go
through the SFT dialects registered on `SFT_DIALECTS` (``skylift.compat.skyrl.sft_keys``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from skylift.config.errors import ConfigError
from skylift.config.fields import _f, _group
from skylift.config.schema import AdapterConfig, FSDPConfig, OptimizerConfig
from skylift.utils.hooks import Hook

TRAIN_ON = ("all_assistant_messages", "last_assistant_message")


@dataclass
class SFTModelConfig:
    """The trained weights, optionally through LoRA adapters."""

    path: str = _f(
        "smollm2-135m-instruct", "model: registry name (tiny-qwen2, ...), local directory or Hub id"
    )
    lora: AdapterConfig = _group(AdapterConfig, "LoRA settings (rank 0: full fine-tuning)")


@dataclass
class SFTPlacementConfig:
    """Where the training ranks run."""

    backend: str = _f(
        "auto",
        "auto (Ray when more than one rank) | ray | local (one rank in this process)",
        choices=("auto", "ray", "local"),
    )
    num_nodes: int = _f(1, "nodes of training ranks", ge=1)
    num_gpus_per_node: int = _f(1, "training ranks (GPUs, or CPU processes) per node", ge=1)


@dataclass
class SFTConfig:
    """Root of `skylift sft`'s configuration."""

    model: SFTModelConfig = _group(SFTModelConfig, "trained weights")
    optimizer_config: OptimizerConfig = _group(OptimizerConfig, "optimizer", lr=1.0e-5)
    fsdp_config: FSDPConfig = _group(FSDPConfig, "FSDP2 settings")
    placement: SFTPlacementConfig = _group(SFTPlacementConfig, "rank placement")
    sequence_parallel_size: int = _f(1, "Ulysses sequence-parallel group size", ge=1)
    objective: str = _f(
        "sft",
        "sft: next-token loss on the assistant's tokens; dpo: preference pairs (chosen/rejected); "
        "reward: a reward model (scalar head, Bradley-Terry loss) on preference pairs",
        choices=("sft", "dpo", "reward"),
    )
    dpo_loss: str = _f("sigmoid", "objective=dpo: sigmoid (DPO) or ipo", choices=("sigmoid", "ipo"))
    dpo_beta: float = _f(0.1, "objective=dpo: beta (the strength of the reference)", gt=0)
    center_rewards_coefficient: float | None = _f(
        None, "objective=reward: add this times mean((r_chosen + r_rejected)^2) to the loss", ge=0
    )
    # data
    train_datasets: list[str] = _f([], "chat datasets: .jsonl/.json/.parquet files or Hub dataset names")
    train_dataset_splits: list[str] | None = _f(None, "Hub split of each train dataset (default 'train')")
    train_dataset_weights: list[float] | None = _f(
        None, "mix the train datasets by these weights per batch (default: by their sizes)"
    )
    eval_datasets: list[str] = _f([], "datasets whose loss is reported every eval_interval steps")
    eval_dataset_splits: list[str] | None = _f(None, "Hub split of each eval dataset (default 'validation')")
    messages_key: str = _f("messages", "column of chat messages (else prompt/completion columns are read)")
    tools_key: str = _f("tools", "column of per-row tool schemas (optional)")
    train_on_what: str = _f("all_assistant_messages", "assistant turns that carry the loss", choices=TRAIN_ON)
    chat_template_kwargs: dict[str, Any] = _f({}, "extra keyword arguments of apply_chat_template")
    max_length: int | None = _f(
        None, "truncate tokenized rows to this many tokens; null = no truncation", ge=2
    )
    shuffle: bool = _f(True, "a seeded permutation of the rows each epoch (false: file order)")
    # schedule
    num_steps: int | None = _f(None, "optimizer steps; null = num_epochs over the data", ge=1)
    num_epochs: int = _f(1, "passes over the train data when num_steps is null", ge=1)
    batch_size: int = _f(4, "sequences per optimizer step, over all ranks", ge=1)
    micro_train_batch_size_per_gpu: int = _f(
        2, "sequences (objective=reward: pairs) per forward/backward pass on one rank", ge=1
    )
    max_tokens_per_microbatch: int | None = _f(
        None, "micro-batches by a token budget instead of a sequence count", ge=1
    )
    remove_microbatch_padding: bool = _f(
        True, "pack each micro-batch's sequences into one padding-free row (objective=reward pads its pairs)"
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    bf16: bool = _f(False, "bfloat16 compute over float32 weights")
    seed: int = _f(42, "data order and initialisation seed")
    # evaluation, outputs, tracking
    eval_interval: int = _f(0, "eval loss every N steps (and at the end); 0 = only at the end", ge=0)
    eval_before_train: bool = _f(False, "eval loss once before the first step")
    logger: str | list[str] = _f(
        "console", "trackers: console, jsonl, tensorboard, wandb (a list for several)"
    )
    project_name: str = _f("skylift_sft", "project name for trackers")
    run_name: str = _f("skylift_sft_run", "run name for trackers and output directories")
    runs_dir: str | None = _f(None, "where run directories go (default ~/.skylift/runs)")
    log_dir: str | None = _f(None, "tracker files; null = <run dir>/logs")
    ckpt_path: str | None = _f(None, "checkpoint directory; null = <run dir>/ckpts")
    ckpt_interval: int = _f(0, "checkpoint every N steps (and at the end); 0 = never", ge=0)
    max_ckpts_to_keep: int = _f(-1, "keep the newest N checkpoints; -1 = all", or_minus_one="keeps all")
    resume_from: str | None = _f(None, "'latest' (newest under ckpt_path) or a global_step_N directory")
    hf_save_interval: int = _f(0, "Hugging Face export every N steps; 0 = only at the end", ge=0)
    export_path: str | None = _f(None, "Hugging Face exports; null = <run dir>/exports")
    dummy_run_full_ctx: bool = _f(False, "train on random full-length rows (max_length tokens): a speed test")
    dummy_run_max_steps: int = _f(5, "steps of a dummy run", ge=1)
    worker_timeout_s: float = _f(3600.0, "the longest one call to the training ranks may take", gt=0)
    collective_timeout_s: float = _f(600.0, "timeout of every collective between ranks", gt=0)

    def loggers(self) -> list[str]:
        return [self.logger] if isinstance(self.logger, str) else list(self.logger)

    def world_size(self) -> int:
        return self.placement.num_nodes * self.placement.num_gpus_per_node


#: Other projects' SFT command lines: a dialect is a callable that takes the (key, value) pairs in
#: order and returns skylift's, raising `ConfigError` for what skylift does not have.
SFT_DIALECTS: Hook[Callable[[list[tuple[str, Any]]], list[tuple[str, Any]]]] = Hook(
    "sft config dialect", ("skylift.compat.skyrl.sft_keys",)
)


def sft_keys() -> dict[str, Any]:
    """Every leaf key of `SFTConfig` -> its dataclass field."""
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = f

    walk(SFTConfig, "")
    return out


def load_sft_config(
    overrides: Sequence[str] = (), config_file: str | Path | None = None, validate: bool = True
) -> SFTConfig:
    """Defaults, then `config_file` (YAML), then `overrides`, through the dialects, validated
    (`validate=False`: the types only, e.g. to print a configuration still missing its data)."""
    from skylift.config.loading import parse_override

    pairs: list[tuple[str, Any]] = []
    if config_file is not None:
        pairs += _file_pairs(Path(config_file))
    pairs += [parse_override(o) for o in overrides]
    for dialect in SFT_DIALECTS.items():
        pairs = dialect(pairs)
    cfg = OmegaConf.structured(SFTConfig)
    keys = sft_keys()
    for key, value in pairs:
        if key not in keys and not any(key.startswith(k + ".") for k in ("chat_template_kwargs",)):
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"; did you mean {close[0]}?" if close else " (see `skylift sft --help`)"
            raise ConfigError(f"unknown sft config key {key}{hint}", key=key, suggestions=close)
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(
                f"invalid value for {key}: {value!r} ({str(exc).splitlines()[0]})", key=key
            ) from exc
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, SFTConfig)
    if validate:
        validate_sft_config(obj)
    return obj


def format_sft_config(cfg: SFTConfig, with_help: bool = False) -> str:
    """The configuration as YAML (loadable again with ``--config``), each key's help after it."""
    import yaml

    lines: list[str] = []

    def emit(node: Any, depth: int) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            pad = "  " * depth
            note = f"  # {f.metadata['help']}" if with_help and "help" in f.metadata else ""
            if dataclasses.is_dataclass(value):
                lines.append(f"{pad}{f.name}:{note}")
                emit(value, depth + 1)
            else:
                shown = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
                shown = shown.removesuffix("\n...").removesuffix("...").strip()
                lines.append(f"{pad}{f.name}: {shown}{note}")

    emit(cfg, 0)
    return "\n".join(lines) + "\n"


def _file_pairs(path: Path) -> list[tuple[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    container = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(container, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys")
    out: list[tuple[str, Any]] = []

    def walk(node: dict[Any, Any], prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict) and key != "chat_template_kwargs":
                walk(value, key + ".")
            else:
                out.append((key, value))

    walk(container, "")
    return out


def validate_sft_config(cfg: SFTConfig) -> None:
    """Every field's bounds and the combinations below; one `ConfigError` listing the problems."""
    from skylift.config.validation import _check_bounds

    problems: list[str] = []
    _check_bounds(cfg, "", problems)
    n = len(cfg.train_datasets)
    if not cfg.train_datasets and not cfg.dummy_run_full_ctx:
        problems.append("train_datasets must name at least one dataset (or set dummy_run_full_ctx=true)")
    _same_length(problems, "train_dataset_splits", cfg.train_dataset_splits, n, "train_datasets")
    _same_length(problems, "train_dataset_weights", cfg.train_dataset_weights, n, "train_datasets")
    _same_length(
        problems, "eval_dataset_splits", cfg.eval_dataset_splits, len(cfg.eval_datasets), "eval_datasets"
    )
    if cfg.train_dataset_weights is not None and any(w <= 0 for w in cfg.train_dataset_weights):
        problems.append(f"train_dataset_weights must all be > 0, got {cfg.train_dataset_weights}")
    if cfg.batch_size < cfg.world_size():
        problems.append(f"batch_size={cfg.batch_size} is less than the {cfg.world_size()} ranks")
    if cfg.dummy_run_full_ctx and cfg.max_length is None:
        problems.append("dummy_run_full_ctx=true needs max_length (the length of the fabricated rows)")
    if cfg.objective == "reward":
        _reward_problems(cfg, problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(
            f"invalid sft configuration ({len(problems)} problem(s)):\n{lines}", problems=problems
        )


def _reward_problems(cfg: SFTConfig, problems: list[str]) -> None:
    """What reward-model training cannot do: its ranks take equal shares of whole pairs, padded."""
    if cfg.batch_size % cfg.world_size():
        problems.append(
            f"objective=reward: batch_size={cfg.batch_size} pairs must split evenly over the "
            f"{cfg.world_size()} ranks"
        )
    if cfg.sequence_parallel_size > 1:
        problems.append("objective=reward: sequence_parallel_size must be 1 (sequences are not split)")
    if cfg.max_tokens_per_microbatch is not None:
        problems.append(
            "objective=reward: micro-batches are micro_train_batch_size_per_gpu pairs; "
            "unset max_tokens_per_microbatch"
        )
    if cfg.dummy_run_full_ctx:
        problems.append("objective=reward: dummy_run_full_ctx has no pairs to train on")


def _same_length(problems: list[str], key: str, value: Iterable[Any] | None, n: int, of: str) -> None:
    if value is not None and len(list(value)) != n:
        problems.append(f"{key} needs one entry per entry of {of} ({n}), got {list(value)}")


__all__ = [
    "SFT_DIALECTS",
    "SFTConfig",
    "format_sft_config",
    "SFTModelConfig",
    "SFTPlacementConfig",
    "load_sft_config",
    "sft_keys",
]
