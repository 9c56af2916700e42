"""Sampling sessions and `asample`, on top of the lazily started `EngineHost`s.

A sampling session names the weights it samples from: the base model, a sampler checkpoint
(`tinker://…/sampler_weights/<name>`, read from disk) or an ephemeral in-memory snapshot made by
`save_weights_for_sampler` without a name. Engines start on the first sample (or the warm-up an
ephemeral sampler save asks for), never for training nor for a named sampler save.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from skylift.inference.limits import MAX_N
from skylift.tinker.errors import NotFoundError, UserError
from skylift.tinker.images import ImageInput
from skylift.tinker.rendering import check_token_range, json_parts
from skylift.tinker.sampling import EngineHost, to_engine_params
from skylift.tinker.store import SamplingSessionRow
from skylift.tinker.views import parse_tinker_path
from skylift.tinker.wire import encode_sample_response

if TYPE_CHECKING:
    from skylift.tinker.backend import TrainedModel
    from skylift.tinker.service import BaseModelInfo, TinkerService

logger = logging.getLogger(__name__)

#: Most samples one `asample` may ask for (the inference server's limit, `SKYLIFT_MAX_N`).
MAX_NUM_SAMPLES = MAX_N


def load_safetensors_dir(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files in a Hugging Face model directory."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


class SamplingService:
    """Sampling side of a `TinkerService`."""

    def __init__(self, svc: TinkerService) -> None:
        self.svc = svc
        self.engines: dict[str, EngineHost] = svc.engines
        self.vocab: dict[str, int] = {}

    # ---------------------------------------------------------------- engines and weights
    def host(self, info: BaseModelInfo) -> EngineHost:
        host = self.engines.get(info.path)
        if host is None:
            from skylift.training.worker import is_vision_language

            settings = dataclasses.replace(self.svc.config.engine, max_model_len=info.max_model_len)
            vision = is_vision_language(info.path)
            host = self.engines[info.path] = EngineHost(info.name, info.path, settings, vision=vision)
            if vision:
                render_host = self.svc.render_host(info.path)

                async def engine_renders(started: EngineHost) -> None:
                    # rendering moves to the engine; the CPU render server is no longer needed
                    await asyncio.to_thread(render_host.use_engine, started)

                host.on_started.append(engine_renders)
        return host

    def _info_for_path(self, model_path: str) -> BaseModelInfo:
        real = os.path.realpath(model_path)
        for info in self.svc.base_models:
            if info.path == real:
                return info
        raise UserError(f"model at {model_path} is not served here")

    def _loader(self, tag: str, info: BaseModelInfo) -> Any:
        if tag == "base":
            return lambda: load_safetensors_dir(info.path)
        if tag.startswith("ephemeral:"):

            def ephemeral() -> dict[str, torch.Tensor]:
                weights = self.svc.snapshots.get(tag)
                if weights is None:
                    raise UserError(f"the weights of sampling session {tag[10:]} expired; save them again")
                return weights

            return ephemeral
        ckpt = self.svc.store.checkpoint(tag)
        if ckpt is None:
            raise NotFoundError(f"sampler checkpoint {tag} does not exist (deleted?)")
        return lambda: load_safetensors_dir(ckpt.directory)

    def warm_up(self, model_path: str, tag: str) -> None:
        """Start the engine and load `tag` in the background (failures are only logged)."""
        info = self._info_for_path(model_path)
        host = self.host(info)

        async def go() -> None:
            try:
                await host.prefetch(tag, self._loader(tag, info))
            except Exception as exc:
                logger.warning("sampler warm-up for %s failed: %s", tag, exc)

        self.svc._spawn(go())

    def bind_ephemeral(
        self, sampling_id: str, session_id: str, model: TrainedModel, weights: dict[str, torch.Tensor]
    ) -> None:
        tag = f"ephemeral:{sampling_id}"
        snapshots = self.svc.snapshots
        snapshots[tag] = weights
        snapshots.move_to_end(tag)
        while len(snapshots) > self.svc.config.max_snapshots:
            snapshots.popitem(last=False)
        if self.svc.store.get(SamplingSessionRow, sampling_id) is None:
            self.svc.store.add(
                SamplingSessionRow(
                    id=sampling_id,
                    session_id=session_id,
                    base_model=model.config.base_model,
                    source="ephemeral",
                    model_id=model.model_id,
                )
            )
        self.warm_up(model.config.model_path, tag)

    # ---------------------------------------------------------------- sessions
    def create_sampling_session(self, body: dict[str, Any]) -> str:
        session_id = str(body.get("session_id"))
        self.svc.session(session_id)
        sampling_id = f"{session_id}:sample:{int(body.get('sampling_session_seq_id', 0))}"
        if self.svc.store.get(SamplingSessionRow, sampling_id) is not None:
            return sampling_id
        model_path, base_model = body.get("model_path"), body.get("base_model")
        if model_path:
            run_id, kind, _ = parse_tinker_path(model_path)
            if kind != "sampler":
                raise UserError(
                    f"{model_path} is a training checkpoint; sample from a sampler checkpoint "
                    "(save_weights_for_sampler) instead"
                )
            ckpt = self.svc.store.checkpoint(model_path)
            if ckpt is None:
                raise NotFoundError(f"sampler checkpoint {model_path} does not exist")
            base_model = self.svc.get_info(run_id)["model_name"]
            row = SamplingSessionRow(
                id=sampling_id,
                session_id=session_id,
                base_model=base_model,
                model_path=model_path,
                source="path",
            )
        else:
            self.svc.base_model(base_model)
            row = SamplingSessionRow(
                id=sampling_id, session_id=session_id, base_model=str(base_model), source="base"
            )
        self.svc.store.add(row)
        return sampling_id

    def get_sampler(self, sampling_id: str) -> dict[str, Any]:
        row = self.svc.store.get(SamplingSessionRow, sampling_id)
        if row is None:
            raise NotFoundError(f"unknown sampler {sampling_id!r}")
        return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}

    # ---------------------------------------------------------------- sampling
    def asample(self, body: dict[str, Any], idem: str | None) -> tuple[str, list[str]]:
        num = body.get("num_samples", 1)
        if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= MAX_NUM_SAMPLES:
            raise UserError(f"num_samples must be an integer in [1, {MAX_NUM_SAMPLES}], got {num!r}")
        hub = self.svc._hub()
        sampling_id = body.get("sampling_session_id")
        seq = body.get("seq_id")
        keys = [
            f"sample:{sampling_id}:{seq}" if sampling_id and seq is not None else None,
            f"idem:{idem}" if idem else None,
        ]
        request_id, new = hub.submit("sample", None, keys)
        sequence_ids = [f"{request_id}:{i}" for i in range(num)]
        if new:
            hub.start(request_id, lambda: self._sample(body))
        return request_id, sequence_ids

    def _target(self, body: dict[str, Any]) -> tuple[str, BaseModelInfo]:
        sampling_id = body.get("sampling_session_id")
        if sampling_id:
            row = self.svc.store.get(SamplingSessionRow, sampling_id)
            if row is None:
                raise NotFoundError(f"unknown sampling session {sampling_id!r}")
            info = self.svc.base_model(row.base_model)
            tag = {"base": "base", "path": row.model_path, "ephemeral": f"ephemeral:{row.id}"}[row.source]
            return str(tag), info
        if body.get("model_path"):
            path = str(body["model_path"])
            run_id, _, _ = parse_tinker_path(path)
            return path, self.svc.base_model(self.svc.get_info(run_id)["model_name"])
        return "base", self.svc.base_model(body.get("base_model"))

    def _vocab_size(self, info: BaseModelInfo) -> int:
        if info.path not in self.vocab:
            from transformers import AutoConfig

            self.vocab[info.path] = int(AutoConfig.from_pretrained(info.path).get_text_config().vocab_size)
        return self.vocab[info.path]

    async def _sample(self, body: dict[str, Any]) -> bytes:
        tag, info = self._target(body)
        parts = json_parts((body.get("prompt") or {}).get("chunks") or [], where="prompt")
        with_images = any(isinstance(p, ImageInput) for p in parts)
        host = self.host(info)
        if with_images:
            if not host.vision:
                raise UserError(f"{info.name} is not a vision-language model; the prompt has image chunks")
            if body.get("prompt_logprobs"):
                raise UserError(
                    "prompt_logprobs for prompts with images are not supported by this server yet"
                )
            await host.prefetch(tag, self._loader(tag, info))  # the engine renders from now on
            prompt = (await self.svc.render_host(info.path).render_parts(parts)).tokens
        else:
            prompt = [t for p in parts if not isinstance(p, ImageInput) for t in p]
        if not prompt:
            raise UserError("prompt is empty")
        check_token_range(prompt, self._vocab_size(info), "prompt")
        num = int(body.get("num_samples", 1))
        if num < 1:
            raise UserError(f"num_samples must be >= 1, got {num}")
        if int(body.get("topk_prompt_logprobs") or 0) > 0 or int(body.get("topk_sample_logprobs") or 0) > 0:
            raise UserError("top-k logprobs are not supported by this server yet")
        if int(body.get("prompt_alt_tokens_k") or 0) > 0 or body.get("target_prompt_logprobs") is not None:
            raise UserError(
                "prompt_alt_tokens_k and target_prompt_logprobs are not supported by this server yet"
            )
        params = to_engine_params(body.get("sampling_params") or {}, len(prompt), info.max_model_len, num)
        want_plp = bool(body.get("prompt_logprobs"))
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and not 1 <= int(last_n) <= len(prompt) - 1:
            raise UserError(f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}], got {last_n}")
        if with_images:
            result = await host.sample_images(tag, self._loader(tag, info), parts, params)
        else:
            result = await host.sample(tag, self._loader(tag, info), prompt, params, want_plp)
        plp = result.prompt_logprobs
        if plp is not None and last_n is not None:
            cut = len(plp) - int(last_n)
            plp = [math.nan] * cut + plp[cut:]
        return encode_sample_response(result.sequences, plp)
