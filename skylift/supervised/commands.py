"""`skylift sft`: supervised fine-tuning on chat datasets, on the RL trainer's Ray + FSDP2 ranks."""

from __future__ import annotations

import argparse
import sys

SFT_EPILOG = """\
examples:
  skylift sft model.path=smollm2-135m-instruct train_datasets=[chats.jsonl] batch_size=8 num_steps=100
  skylift sft model.path=Qwen/Qwen2.5-0.5B-Instruct model.lora.rank=32 train_datasets=[HuggingFaceH4/no_robots] \\
      train_dataset_splits=[train] eval_datasets=[HuggingFaceH4/no_robots] eval_dataset_splits=[test] eval_interval=50
  skylift sft objective=reward model.path=smollm2-135m-instruct train_datasets=[pairs.jsonl] batch_size=8
  skylift sft --dry-run <overrides>   # check a command line (SkyRL's main_sft keys too) without running it
keys: `skylift sft --show-config` prints every key with its default and help (docs/sft.md).
"""

#: what to change when a rank runs out of memory (every objective: sft, dpo, reward); the keys of
#: `SFTConfig` (tests/unit/test_sft_out_of_memory.py checks that each exists)
OUT_OF_MEMORY_ADVICE = (
    "To fit, lower micro_train_batch_size_per_gpu (objective sft or dpo: or set "
    "max_tokens_per_microbatch), set gradient_checkpointing=true and bf16=true, shorten max_length, "
    "train LoRA adapters (model.lora.rank=16) instead of every weight, or spread the model over more "
    "ranks (placement.num_gpus_per_node: FSDP2 shards weights and optimizer state; with several ranks "
    "fsdp_config.cpu_offload=true keeps them in host memory). With ckpt_interval set, rerun with "
    "resume_from=latest to continue from the last checkpoint"
)


def add_sft_command(sub: argparse._SubParsersAction) -> None:
    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat datasets (messages / prompt-completion), full or LoRA",
        epilog=SFT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sft.add_argument("overrides", nargs="*", metavar="key.sub=value")
    sft.add_argument("--config", dest="config_file", default=None, help="YAML file of configuration values")
    sft.add_argument(
        "--dry-run", action="store_true", help="check the configuration and print it; train nothing"
    )
    sft.add_argument("--show-config", action="store_true", help="print every key with its default and help")
    sft.add_argument("--verbose", action="store_true", help="let the libraries print their own messages")
    sft.set_defaults(func=run_sft_command)


def run_sft_command(args: argparse.Namespace) -> int:
    from skylift.config.errors import ConfigError
    from skylift.config.sft import format_sft_config, load_sft_config

    try:
        cfg = load_sft_config(args.overrides, args.config_file, validate=not args.show_config)
    except ConfigError as exc:
        print(f"skylift sft: {exc}", file=sys.stderr)
        return 2
    if args.show_config or args.dry_run:
        print(format_sft_config(cfg, with_help=args.show_config), end="")
        if args.dry_run:
            from skylift.models import is_missing_local_path

            if is_missing_local_path(cfg.model.path):
                print(f"note: model.path={cfg.model.path} names no directory on this machine")
            print("configuration OK (dry run: nothing trained; Hub datasets are read when the run starts)")
        return 0
    from skylift.cluster.placement import PlacementError
    from skylift.data.chat import ChatDataError
    from skylift.supervised.tokens import TokenizeError
    from skylift.supervised.trainer import SupervisedTrainer
    from skylift.utils.memory_errors import out_of_memory_line
    from skylift.utils.messages import said
    from skylift.utils.quiet import quiet_libraries

    quiet_libraries(args.verbose)
    trainer_cls = SupervisedTrainer
    if cfg.objective == "dpo":
        from skylift.supervised.dpo import PreferenceTrainer

        trainer_cls = PreferenceTrainer
    elif cfg.objective == "reward":
        from skylift.supervised.reward import RewardModelTrainer

        trainer_cls = RewardModelTrainer
    try:
        trainer = trainer_cls(cfg)
    except (ChatDataError, TokenizeError, ValueError) as exc:  # PreferenceDataError too
        print(f"skylift sft: {exc}", file=sys.stderr)
        return 2
    try:
        trainer.start()
        losses = trainer.run()
    except PlacementError as exc:  # more ranks than the cluster can place
        return said("skylift sft", f"placement: {exc}", exc, 2, args.verbose)
    except Exception as exc:  # a rank's allocation failure, perhaps behind a Ray error: one line
        if (line := out_of_memory_line(exc, OUT_OF_MEMORY_ADVICE)) is None:
            raise  # not the machine's memory: a bug, its traceback kept
        # nothing is saved: the step that failed may have changed part of the state
        return said("skylift sft", line, exc, 5, args.verbose)
    finally:
        trainer.close()  # also after a failed start (the ranks it made, Ray)
    if losses:
        print(
            f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; outputs in {trainer.paths.root}"
        )
    return 0


__all__ = ["OUT_OF_MEMORY_ADVICE", "add_sft_command", "run_sft_command"]
