"""Where one base model's images get rendered: a CPU render server until the engines are up.

The first image-bearing batch starts the base model's `CPURenderServer` (once; concurrent batches
wait for the same start-up). Text-only batches never come here. When the model's inference engine
starts (sampling), `use_engine` points rendering at the engine and shuts the CPU server down; when
the last loaded model of that base is released, `close` shuts it down too.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from skylift.tinker.core.wire import WireDatum
from skylift.tinker.vision.render import Part, RenderClient, RenderedInput, VisionRenderer
from skylift.tinker.vision.render_server import (
    CPURenderServer,
    RenderServerClient,
    RenderServerError,
    process_rss_mb,
)

logger = logging.getLogger(__name__)


class RenderHost:
    """Renders images for one base model (see the module docstring)."""

    def __init__(self, model_path: str, max_model_len: int | None, log_path: Path | None = None) -> None:
        self.model_path = model_path
        self.server = CPURenderServer(model_path, max_model_len=max_model_len, log_path=log_path)
        self.server_starts = 0
        self.images_rendered = 0
        self._server_client: RenderServerClient | None = None
        self._engine_client: RenderClient | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def backend(self) -> str:
        if self._engine_client is not None:
            return "engine"
        return "render_server" if self.server.running else "none"

    async def _client(self) -> RenderClient:
        if self._engine_client is not None:
            return self._engine_client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._server_client is None or not self.server.running:
                url = await asyncio.to_thread(self.server.start)
                self.server_starts += 1
                self._server_client = RenderServerClient(url)
            return self._server_client

    async def render_parts(self, parts: list[Part]) -> RenderedInput:
        """One model input (a sampling prompt)."""
        renderer = VisionRenderer(await self._client(), self.model_path)
        return await renderer.render(parts)

    async def render_datums(self, data: list[WireDatum]) -> None:
        """Fill in tokens, pixel_values and image_grid_thw of every datum that has images."""
        todo = [d for d in data if d.needs_render]
        if not todo:
            return
        inputs = [d.parts or [] for d in todo]
        try:
            results = await VisionRenderer(await self._client(), self.model_path).render_many(inputs)
        except RenderServerError:
            if self._engine_client is None:
                raise
            # the engine came up mid-batch and the CPU server was stopped under it: render there
            results = await VisionRenderer(self._engine_client, self.model_path).render_many(inputs)
        for datum, rendered in zip(todo, results, strict=True):
            datum.tokens = rendered.tokens
            datum.pixel_values = rendered.pixel_values
            datum.image_grid_thw = rendered.image_grid_thw
            self.images_rendered += (
                0 if rendered.image_grid_thw is None else int(rendered.image_grid_thw.shape[0])
            )

    def use_engine(self, client: RenderClient) -> None:
        """Render with the engine from now on; stop the CPU server (blocking)."""
        self._engine_client = client
        self._server_client = None
        if self.server.running:
            logger.info(
                "engine for %s is up: rendering moves to it, CPU render server stops", self.model_path
            )
        self.server.stop()

    def engine_gone(self) -> None:
        self._engine_client = None

    def close(self) -> None:
        """Stop the CPU server (blocking; it starts again on the next image batch)."""
        self._server_client = None
        self.server.stop()

    def status(self) -> dict[str, Any]:
        pid = self.server.pid if self.server.running else None
        return {
            "model_path": self.model_path,
            "backend": self.backend,
            "render_server_running": self.server.running,
            "render_server_pid": pid,
            "render_server_starts": self.server_starts,
            "render_server_startup_s": self.server.startup_s,
            "render_server_rss_mb": process_rss_mb(pid) if pid is not None else 0.0,
            "images_rendered": self.images_rendered,
        }


class RenderHosts:
    """The render host of each base model (by path), created on first use; starts nothing itself."""

    def __init__(self, data_dir: Path, max_model_len: dict[str, int]) -> None:
        self.data_dir = data_dir
        self.max_model_len = max_model_len
        self.hosts: dict[str, RenderHost] = {}

    def get(self, model_path: str) -> RenderHost:
        host = self.hosts.get(model_path)
        if host is None:
            host = RenderHost(
                model_path,
                max_model_len=self.max_model_len.get(model_path),
                log_path=self.data_dir / f"render-server-{len(self.hosts)}.log",
            )
            self.hosts[model_path] = host
        return host

    def close_all(self) -> None:
        for host in self.hosts.values():
            host.close()
