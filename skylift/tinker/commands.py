"""`skylift tinker serve`: run the Tinker-compatible training service."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from skylift.config.services import LORA_MODES

#: The Tinker server's single key, when neither --api-key nor --api-keys-file is given.
API_KEY_ENV = "SKYLIFT_TINKER_API_KEY"


def add_tinker_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `tinker serve` on the `skylift` command's subparsers."""
    tinker = subparsers.add_parser("tinker", help="Tinker-compatible training service")
    sub = tinker.add_subparsers(dest="tinker_command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the Tinker API (the official `tinker` SDK connects to it)")
    serve.add_argument(
        "--base-model",
        action="append",
        required=True,
        dest="base_models",
        metavar="NAME",
        help="model that clients may train and sample (registry name or local HF directory); repeatable",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--database-url",
        "--db",
        dest="db",
        default=None,
        metavar="URL",
        help="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db (default: sqlite in --data-dir); "
        "the schema is upgraded on start",
    )
    serve.add_argument(
        "--data-dir", default="skylift-tinker-data", metavar="DIR", help="checkpoints live here"
    )
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key",
        default=None,
        help=f"require this X-API-Key: one user (default: ${API_KEY_ENV}, else accept any; the variable "
        "or --api-keys-file keeps the key out of `ps`)",
    )
    keys.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="users and their keys, one 'USER KEY' per line (# comments); each user sees only its own "
        "records; SIGHUP reloads the file",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --host beyond loopback without a key (anyone who reaches it may train, sample "
        "and delete checkpoints)",
    )
    serve.add_argument(
        "--result-retention-s",
        type=float,
        default=3600.0,
        metavar="S",
        help="delete a future's result this many seconds after it was retrieved (default: 3600)",
    )
    serve.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: model's, <= 4096)"
    )
    serve.add_argument(
        "--session-timeout",
        type=float,
        default=300.0,
        help="seconds without heartbeat before a session is finished",
    )
    serve.add_argument(
        "--cleanup-interval", type=float, default=30.0, help="seconds between stale-session sweeps"
    )
    serve.add_argument(
        "--long-poll", type=float, default=20.0, help="seconds a retrieve_future waits before 408"
    )
    serve.add_argument(
        "--snapshot-memory-mb",
        type=float,
        default=8192.0,
        help="memory for the in-memory weights of ephemeral samplers (save_weights_and_get_sampling_client); "
        "a snapshot held by a live session is never dropped, and one that does not fit is refused",
    )
    serve.add_argument(
        "--max-idle-snapshots",
        type=int,
        default=4,
        help="snapshots of finished sessions kept for late samples (oldest dropped first)",
    )
    serve.add_argument(
        "--allowed-local-media-path",
        action="append",
        default=[],
        dest="allowed_local_media_paths",
        metavar="DIR",
        help="image_asset_pointer chunks may name regular files under DIR (repeatable; default: none, "
        "every pointer is refused)",
    )
    serve.add_argument(
        "--max-request-mb",
        type=float,
        default=256.0,
        metavar="MB",
        help="largest request body, also after zstd decompression (default: 256); larger ones get 413",
    )
    serve.add_argument(
        "--max-request-cells",
        type=int,
        default=16 * 1024 * 1024,
        metavar="N",
        help="most loss-input cells of one forward/forward_backward, padded to its longest datum "
        "(default: 16777216)",
    )
    serve.add_argument(
        "--future-max-age-s",
        type=float,
        default=86400.0,
        metavar="S",
        help="delete a future never retrieved this long after it was made (default: 86400)",
    )
    for flag, kind, default, text in (
        (
            "--fair-wait-timeout-s",
            float,
            600.0,
            "longest wait for a turn on the training thread or an engine (429 after)",
        ),
        (
            "--sampling-slots",
            int,
            4,
            "sample requests one engine serves at once; the rest wait round robin by user",
        ),
        ("--max-pending-per-user", int, 1024, "futures one user may have pending at once (429 beyond)"),
        (
            "--max-snapshot-mb-per-user",
            float,
            4096.0,
            "memory of the sampler snapshots one user's live sessions hold",
        ),
        (
            "--max-record-tokens-per-user",
            int,
            5_000_000,
            "stability-record tokens kept per user (oldest dropped)",
        ),
        ("--max-checkpoint-gb-per-user", float, 1024.0, "checkpoint disk one user may use (429 beyond)"),
        (
            "--max-clients-per-user",
            int,
            64,
            "live training clients one user may hold (LoRA or full; the users file may set max_clients=N)",
        ),
        (
            "--max-adapters-per-user",
            int,
            64,
            "LoRA adapters one user may train at once (the users file may set max_adapters=N)",
        ),
        (
            "--sampler-max-lora-rank",
            int,
            32,
            "highest LoRA rank a sampling engine serves as an adapter (higher ranks swap merged weights)",
        ),
        ("--sampler-max-loras", int, 4, "LoRA adapters one engine batch may mix (vLLM's max_loras)"),
        (
            "--sampler-lora-slots",
            int,
            8,
            "LoRA adapters one sampling engine holds at once; beyond, the least recently used is evicted "
            "and reloaded on demand",
        ),
    ):
        serve.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    serve.add_argument(
        "--sampler-lora",
        choices=LORA_MODES,
        default="auto",
        help="how a sampling engine serves its base model's LoRA samplers: adapters in the batch, "
        "swaps of merged weights, or auto: measured once per engine at start-up, the faster one "
        "(default: auto)",
    )
    serve.add_argument(
        "--training-memory-gb",
        type=float,
        default=None,
        metavar="GB",
        help="memory training clients may hold: each base model once, adapters, full fine-tunes, "
        "gradients and optimizer state; a new client that does not fit is refused with a 400 "
        "(default: 70%% of the GPU's memory, else of the machine's RAM)",
    )
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)
    tinker.set_defaults(func=lambda args: (tinker.print_help(), 2)[1])


def check_exposure(host: str, api_key: str | None, api_keys_file: str | None, insecure: bool) -> bool:
    """`SystemExit` when the server would listen beyond loopback without a key, unless `insecure`
    (then a warning, and True)."""
    from skylift.inference.server import is_loopback_host

    if api_key or api_keys_file or is_loopback_host(host):
        return False
    exposure = (
        f"binding to {host or '0.0.0.0'!r} without an API key: anyone who can reach this host can "
        "train, sample, and read or delete checkpoints"
    )
    if not insecure:
        raise SystemExit(
            f"refused: {exposure}; give --api-keys-file FILE or ${API_KEY_ENV} (or --api-key), or pass "
            "--insecure to serve without a key"
        )
    logging.getLogger("skylift.tinker").warning("%s (--insecure)", exposure)
    return True


def api_key_from(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str | None:
    """--api-key, else $SKYLIFT_TINKER_API_KEY when no --api-keys-file is given."""
    if args.api_key or args.api_keys_file:
        return str(args.api_key) if args.api_key else None
    return environ.get(API_KEY_ENV) or None


def private_data_dir(path: Path) -> Path:
    """The data directory, private to the server's user: everything the process creates from now
    on (checkpoints, the SQLite database) is too (umask 077)."""
    os.umask(0o077)
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def refuse_sampler_lora(base_models: list[str], max_model_len: int | None, flag: str) -> None:
    """`SystemExit` (one line) for ``--sampler-lora adapters`` with a mixture-of-experts base
    (`skylift.tinker.sampling.lora_mode.fixed_swap`), before the data directory, the database or
    anything else is created on disk; the bases' configs are read only under that flag."""
    if flag != "adapters":
        return
    from skylift.tinker.core.base_models import describe_base_model
    from skylift.tinker.sampling.lora_mode import fixed_swap

    for name in base_models:
        info = describe_base_model(name, max_model_len)
        fixed_swap(info.name, info.moe, False, flag)


def _media_root(raw: str) -> Path:
    path = Path(os.path.abspath(raw))
    if not path.is_dir():
        raise SystemExit(f"--allowed-local-media-path {raw}: not a directory")
    return path


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from skylift.config.services import EngineSettings
    from skylift.tinker.app import create_app
    from skylift.tinker.service import ServerConfig

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.api_key = api_key_from(args)
    check_exposure(args.host, args.api_key, args.api_keys_file, args.insecure)
    for flag, value in (
        ("--result-retention-s", args.result_retention_s),
        ("--max-request-mb", args.max_request_mb),
        ("--max-request-cells", args.max_request_cells),
        ("--future-max-age-s", args.future_max_age_s),
        ("--fair-wait-timeout-s", args.fair_wait_timeout_s),
        ("--sampling-slots", args.sampling_slots),
        ("--max-pending-per-user", args.max_pending_per_user),
        ("--max-snapshot-mb-per-user", args.max_snapshot_mb_per_user),
        ("--max-record-tokens-per-user", args.max_record_tokens_per_user),
        ("--max-checkpoint-gb-per-user", args.max_checkpoint_gb_per_user),
        ("--max-clients-per-user", args.max_clients_per_user),
        ("--max-adapters-per-user", args.max_adapters_per_user),
        ("--sampler-max-lora-rank", args.sampler_max_lora_rank),
        ("--sampler-max-loras", args.sampler_max_loras),
        ("--sampler-lora-slots", args.sampler_lora_slots),
        ("--training-memory-gb", 1 if args.training_memory_gb is None else args.training_memory_gb),
    ):
        if value <= 0:
            raise SystemExit(f"{flag} must be > 0, got {value}")
    refuse_sampler_lora(args.base_models, args.max_model_len, args.sampler_lora)
    data_dir = private_data_dir(Path(args.data_dir))
    db = args.db or f"sqlite:///{data_dir / 'tinker.db'}"
    config = ServerConfig(
        base_models=list(args.base_models),
        db_url=db,
        data_dir=data_dir,
        api_key=args.api_key,
        api_keys_file=Path(args.api_keys_file).resolve() if args.api_keys_file else None,
        result_retention_s=args.result_retention_s,
        max_model_len=args.max_model_len,
        session_timeout_s=args.session_timeout,
        cleanup_interval_s=args.cleanup_interval,
        long_poll_s=args.long_poll,
        snapshot_memory_mb=args.snapshot_memory_mb,
        max_idle_snapshots=args.max_idle_snapshots,
        allowed_local_media_paths=[_media_root(p) for p in args.allowed_local_media_paths],
        max_request_mb=args.max_request_mb,
        max_request_cells=args.max_request_cells,
        future_max_age_s=args.future_max_age_s,
        fair_wait_timeout_s=args.fair_wait_timeout_s,
        sampling_slots=args.sampling_slots,
        max_pending_per_user=args.max_pending_per_user,
        max_snapshot_mb_per_user=args.max_snapshot_mb_per_user,
        max_record_tokens_per_user=args.max_record_tokens_per_user,
        max_checkpoint_gb_per_user=args.max_checkpoint_gb_per_user,
        training_memory_gb=args.training_memory_gb,
        max_clients_per_user=args.max_clients_per_user,
        max_adapters_per_user=args.max_adapters_per_user,
        engine=EngineSettings(
            lora_mode=args.sampler_lora,
            max_lora_rank=args.sampler_max_lora_rank,
            max_loras=args.sampler_max_loras,
            lora_slots=args.sampler_lora_slots,
        ),
    )
    app = create_app(config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_keep_alive=30)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m skylift.tinker.commands serve ...` (used by tests; same flags as `skylift tinker`)."""
    parser = argparse.ArgumentParser(prog="skylift")
    add_tinker_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tinker", *(argv if argv is not None else __import__("sys").argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
