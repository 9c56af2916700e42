"""Every ``SKYLIFT_*`` environment variable, in one place.

Settings belong in the typed config (``schema.py``, ``services.py``) or on a command line; these
few are read from the environment because they must reach processes skylift does not start with
its own arguments (vLLM's engine processes, Ray workers, test servers) or tune a process-wide
default. `tests/unit/test_environment.py` fails when the code reads a ``SKYLIFT_*`` variable that
is not listed here, or when one listed here is read nowhere.
"""

from __future__ import annotations

#: name -> (who reads it, what it does and its default)
SKYLIFT_ENVIRONMENT: dict[str, tuple[str, str]] = {
    "SKYLIFT_CACHE_DIR": ("all", "root of the model and data cache (default ~/.cache/skylift)"),
    "SKYLIFT_RUNS_DIR": ("skylift train / demo", "where runs go when trainer.runs_dir is null (default ~/skylift/runs)"),
    "SKYLIFT_API_KEY": ("skylift train", "API key sent to remote inference servers (generator.remote_inference_engine_urls)"),
    "SKYLIFT_MAX_N": ("skylift serve", "most samples per prompt on every route (default 256; InferenceServerLimits)"),
    "SKYLIFT_MAX_PROMPTS": ("skylift serve", "most prompts in one /skylift/generate request (default 4096)"),
    "SKYLIFT_MAX_SEQUENCES": (
        "skylift serve",
        "most sequences (prompts x n) in one /skylift/generate request (default 16384)",
    ),
    "SKYLIFT_MAX_REQUEST_TOKENS": (
        "skylift serve",
        "most tokens (prompts x n x max_tokens) one /skylift/generate request may ask for (default 2^25)",
    ),
    "SKYLIFT_MAX_GENERATE_BODY_MB": ("skylift serve", "largest body of vLLM's /inference/v1/generate, in MiB (default 32)"),
    "SKYLIFT_WEIGHT_RPC_TIMEOUT_S": ("skylift serve", "timeout of one weight-bucket receive (default 600 s)"),
    "SKYLIFT_HTTP_CONNECTION_LIMIT": ("HTTP clients", "connections per client session, all hosts together (default 256)"),
    "SKYLIFT_HTTP_KEEPALIVE_S": ("HTTP clients", "idle keep-alive of pooled connections (default 4 s, below uvicorn's 5 s)"),
    "SKYLIFT_AUTO_CPU_THREADS_BIND": ("engines (set by skylift)", "marks a CPU thread binding skylift chose, so a child server rebinds per rank"),
    "SKYLIFT_ENGINE_START_CAUSE": ("engines (set by skylift)", "the file a vLLM process that fails to start writes its cause to (vllm_patches.start_cause)"),
    "SKYLIFT_TINKER_API_KEY": ("skylift tinker serve", "the server's single X-API-Key when neither --api-key nor --api-keys-file is given (kept out of `ps`)"),
    "SKYLIFT_TINKER_FAIL_ENGINE_START": ("skylift tinker serve (tests)", "1: every sampling-engine start-up fails (tests that must never start vLLM)"),
    "SKYLIFT_TORCH_INDEX_URL": (
        "scripts/setup.sh (GPU machines)",
        "the one index the CUDA build of torch comes from (PyPI's simple index or a mirror; unset: pip's own)",
    ),
    "SKYLIFT_IN_NETNS": ("scripts (tests)", "1: already inside the loopback-only network namespace"),
    "SKYLIFT_TEST_SPLIT": ("scripts/test.sh", "0: run the suite in one pytest process instead of two halves pinned to one core each"),
    "SKYLIFT_TESTS_ALLOW_NETWORK": ("tests", "1: run server tests outside a loopback-only namespace"),
    "SKYLIFT_SOAK_S": ("benchmarks/tinker_soak.py", "seconds of the attacked phase (default 600)"),
    "SKYLIFT_SOAK_ALONE_S": ("benchmarks/tinker_soak.py", "seconds of the well-behaved client alone (default 90)"),
    "SKYLIFT_TEST_SERVER_STARTUP_S": ("tests", "how long the tests wait for a test server to start (default 420 s)"),
    "SKYLIFT_GSM8K_DIR": ("tests", "directory of the GSM8K jsonl files (default: shared/data/gsm8k)"),
    "SKYLIFT_UNTESTED_VLLM": ("engines, skylift serve", "1: apply skylift's vLLM patches to a vLLM they were not written for, with a warning, instead of stopping at start-up"),
    "SKYLIFT_ENGINE_DEATH_REPEATS": ("tests/reliability", "how many fresh engines the local engine-kill test kills in a row (default 1)"),
    "SKYLIFT_GPU_CHECK_BLOCK": ("tests/gpu", "modules the GPU check makes unimportable (comma-separated)"),
}  # fmt: skip
