"""`skylift view --serve`: the report's folder over HTTP on the loopback interface."""

from __future__ import annotations

import functools
import http.server
from pathlib import Path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no line per request
        pass


def report_server(folder: Path, port: int) -> http.server.ThreadingHTTPServer:
    """A server of `folder` on 127.0.0.1:`port` (0: a free port), not yet serving."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


def serve_folder(folder: Path, port: int) -> None:
    """Serve `folder` until Ctrl-C, printing its address."""
    server = report_server(folder, port)
    print(
        f"serving the report at http://127.0.0.1:{server.server_address[1]}/index.html (Ctrl-C stops)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
