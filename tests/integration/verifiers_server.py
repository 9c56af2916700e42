"""Serve tests/integration/verifiers_taskset.py with verifiers' own env server:
`python verifiers_server.py tcp://127.0.0.1:PORT` (the harness runs in a subprocess runtime on
this host; the env server samples from the endpoint each run request names)."""

from __future__ import annotations

import logging
import sys

from verifiers.v1.serve import serve_env
from verifiers.v1.utils.loaders import resolve_env_config


def main(address: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = resolve_env_config(
        {"taskset": {"id": "verifiers_taskset"}, "agent": {"runtime": {"type": "subprocess"}}}
    )
    serve_env(max_workers=1, address=address, config=config)


if __name__ == "__main__":
    main(sys.argv[1])
