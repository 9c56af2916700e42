"""Sampling sessions and `asample`, on top of the lazily started `EngineHost`s.

A sampling session names the weights it samples from: the base model, a sampler checkpoint
(`tinker://…/sampler_weights/<name>`, read from disk) or an ephemeral in-memory snapshot made by
`save_weights_for_sampler` without a name. Engines start on the first sample (or the warm-up an
ephemeral sampler save asks for), never for training nor for a named sampler save. The store is
read off the event loop: the async methods read it in a worker thread; the plain ones that read
it (`create_sampling_session`, `get_sampler`) block and are called in one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from skylift.algorithms.sample_support import sampled_distribution
from skylift.inference.limits import MAX_N
from skylift.tinker.core.auth import current_user
from skylift.tinker.core.base_models import BaseModelInfo, BaseModels
from skylift.tinker.core.bodies import MAX_TARGET_CELLS
from skylift.tinker.core.fairness import FairGate
from skylift.tinker.core.futures import Work
from skylift.tinker.core.images import ImageInput
from skylift.tinker.core.model_input import check_token_range, json_parts
from skylift.tinker.core.provenance import StabilityRecords
from skylift.tinker.core.requests import Requests
from skylift.tinker.core.wire import encode_sample_response
from skylift.tinker.errors import UserError
from skylift.tinker.sampling.bodies import CreateSamplingSessionBody, SampleBody, TargetTensor
from skylift.tinker.sampling.engine_host import EngineHost, EngineSettings
from skylift.tinker.sampling.lora_mode import MOE_SWAP, fixed_swap
from skylift.tinker.sampling.sample_io import PromptScores, to_engine_params
from skylift.tinker.sampling.snapshots import SnapshotStore, Weights
from skylift.tinker.sampling.weights import (
    SamplerSnapshot,
    SamplerWeights,
    adapter_in,
    load_safetensors_dir,
    merged_into_base,
)
from skylift.tinker.storage.store import ModelRow, SamplingSessionRow, SessionRow, Store
from skylift.tinker.storage.views import parse_tinker_path
from skylift.tinker.vision.host import RenderHosts

logger = logging.getLogger(__name__)

#: Most samples one `asample` may ask for (the same cap as the inference server's default `n` limit).
MAX_NUM_SAMPLES = MAX_N
#: Threads that read and decode prompt images (image pointers, base64 images).
MEDIA_THREADS = 4


def _targets(raw: TargetTensor | None) -> np.ndarray | None:
    """`target_prompt_logprobs` (dense or sparse CSR; its shape bounded by the body's type) as an
    int64 [rows, K] array with -1 in cells that ask nothing."""
    if raw is None:
        return None
    shape = raw.shape
    try:
        data = np.asarray(raw.data, dtype=np.int64)
        if raw.sparse_crow_indices is not None and shape is not None:
            crow = np.asarray(raw.sparse_crow_indices, dtype=np.int64)
            col = np.asarray(raw.sparse_col_indices or [], dtype=np.int64)
            dense = np.full(shape, -1, dtype=np.int64)
            for row in range(int(shape[0])):
                dense[row, col[crow[row] : crow[row + 1]]] = data[crow[row] : crow[row + 1]]
        else:
            dense = data.reshape(shape if shape is not None else (-1, 1))
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise UserError(f"target_prompt_logprobs: malformed tensor ({exc})") from exc
    if dense.ndim != 2:
        raise UserError(f"target_prompt_logprobs must be [len(prompt) - 1, K], got shape {list(dense.shape)}")
    cells = int((dense >= 0).sum())
    if cells > MAX_TARGET_CELLS:
        raise UserError(
            f"target_prompt_logprobs asks for {cells} cells; this server's cap is {MAX_TARGET_CELLS}"
        )
    return dense


class SamplingService:
    """Sampling: sessions, engines (one per base model) and the weights they sample from."""

    def __init__(
        self,
        store: Store,
        base_models: BaseModels,
        engine_settings: EngineSettings,
        snapshots: SnapshotStore,
        records: StabilityRecords,
        render_hosts: RenderHosts,
        requests: Requests,
        media_roots: Sequence[Path] = (),
        gate: tuple[int, float | None] = (4, 600.0),
    ) -> None:
        self.store = store
        self.requests = requests
        # on a small CPU machine the first engine splits the cores (`colocated_cpu_split`): its
        # own, and those `confine_server` keeps the rest of the server (training included) on
        self.confine_server = requests.confine_server
        self.engine_cpus: list[int] | None = None
        self._cores_split = False
        # each engine serves `slots` sample requests at once, the waiting ones round robin by user
        self.gate_slots, self.gate_timeout_s = gate
        self.gates: dict[str, FairGate] = {}
        self.media_roots = tuple(media_roots)  # where image pointers may point (--allowed-local-media-path)
        # reading and decoding prompt images: off the event loop, a few at a time
        self.media = ThreadPoolExecutor(max_workers=MEDIA_THREADS, thread_name_prefix="tinker-media")
        self.base_models = base_models
        self.engine_settings = engine_settings
        for info in base_models:  # at start: refused, or said once (the engine starts later)
            if info.moe and fixed_swap(info.name, True, False, engine_settings.lora_mode):
                logger.info("sampling %s: %s", info.name, MOE_SWAP)
        self.snapshots = snapshots
        self.records = records
        self.render_hosts = render_hosts
        self.spawn = requests.spawn
        self.engines: dict[str, EngineHost] = {}
        self.vocab: dict[str, int] = {}

    async def close(self) -> None:
        for host in self.engines.values():
            await asyncio.to_thread(host.close)
        self.media.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- engines and weights
    def gate(self, info: BaseModelInfo) -> FairGate:
        """The fair gate in front of `info`'s engine (`skylift.tinker.core.fairness`)."""
        if info.path not in self.gates:
            what = f"the sampling engine of {info.name}"
            # one user holds at most all slots but one: another user's request starts at once
            self.gates[info.path] = FairGate(
                self.gate_slots, self.gate_timeout_s, what, "--fair-wait-timeout-s", self.gate_slots - 1
            )
        return self.gates[info.path]

    def host(self, info: BaseModelInfo) -> EngineHost:
        host = self.engines.get(info.path)
        if host is None:
            from skylift.worker.vision_inputs import is_vision_language

            settings = dataclasses.replace(self.engine_settings, max_model_len=info.max_model_len)
            vision = is_vision_language(info.path)
            cpus = self._split_cores()
            swap = fixed_swap(info.name, info.moe, vision, settings.lora_mode)
            host = self.engines[info.path] = EngineHost(info.name, info.path, settings, vision, cpus, swap)
            if vision:
                render_host = self.render_hosts.get(info.path)

                async def engine_renders(started: EngineHost) -> None:
                    # rendering moves to the engine; the CPU render server is no longer needed
                    await asyncio.to_thread(render_host.use_engine, started)

                host.on_started.append(engine_renders)
        return host

    def _split_cores(self) -> list[int] | None:
        """The engines' cores (None: every core); the first call splits them off the training
        thread's where `colocated_cpu_split` says so."""
        if not self._cores_split:
            self._cores_split = True
            from skylift.inference.engine_args import colocated_cpu_split

            split = colocated_cpu_split()
            if split is not None and self.confine_server is not None:
                training, self.engine_cpus = split
                self.confine_server(training)
                logger.info(
                    "a small CPU machine: the server and its training on core(s) %s, the inference "
                    "engines' compute on %s (training and sampling run at once)",
                    ",".join(map(str, training)),
                    ",".join(map(str, self.engine_cpus)),
                )
        return self.engine_cpus

    async def _loader(self, tag: str, info: BaseModelInfo) -> SamplerWeights:
        """How to get `tag`'s weights (`SamplerWeights`; a sampler checkpoint's record is read now)."""
        if tag == "base":
            return SamplerWeights(tag, lambda: load_safetensors_dir(info.path))
        if tag.startswith("ephemeral:"):
            snapshot = self.snapshots.get(tag)
            if snapshot is None:
                raise UserError(
                    f"the weights of sampling session {tag[10:]} were dropped: its session ended and "
                    "newer idle snapshots took their place (--max-idle-snapshots); save them again"
                )
            if isinstance(snapshot, SamplerSnapshot):
                full, adapter = snapshot.full, snapshot.adapter
                if full is not None:
                    return SamplerWeights(tag, lambda: full, adapter)
                assert adapter is not None  # a snapshot holds one of the two
                return SamplerWeights(tag, lambda: merged_into_base(info.path, adapter), adapter)
            return SamplerWeights(tag, lambda: snapshot)
        ckpt = await asyncio.to_thread(self.store.require_checkpoint, tag, "sampler checkpoint")
        directory = Path(ckpt.directory)
        adapter = await asyncio.to_thread(adapter_in, directory)
        return SamplerWeights(tag, lambda: load_safetensors_dir(directory), adapter)

    def warm_up(self, model_path: str, tag: str) -> None:
        """Start the engine and load `tag` in the background (failures are only logged)."""
        info = self.base_models.for_path(model_path)
        host = self.host(info)

        async def go() -> None:
            try:
                await host.prefetch(await self._loader(tag, info))
            except Exception as exc:
                logger.warning("sampler warm-up for %s failed: %s", tag, exc)

        self.spawn(go())

    async def bind_ephemeral(
        self,
        sampling_id: str,
        session_id: str,
        model_id: str,
        base_model: str,
        model_path: str,
        weights: Weights,
    ) -> None:
        """Hold `weights` (of training model `model_id`, over `base_model` resolved to `model_path`)
        for sampling session `sampling_id` (an error when they do not fit)."""
        tag = f"ephemeral:{sampling_id}"
        self.snapshots.add(tag, session_id, weights)
        row = SamplingSessionRow(
            id=sampling_id,
            session_id=session_id,
            base_model=base_model,
            source="ephemeral",
            model_id=model_id,
        )
        await asyncio.to_thread(self._add_once, row)
        self.warm_up(model_path, tag)

    def _add_once(self, row: SamplingSessionRow) -> None:
        if self.store.get(SamplingSessionRow, row.id) is None:
            self.store.add(row)

    # ---------------------------------------------------------------- sessions
    def create_sampling_session(self, body: CreateSamplingSessionBody) -> str:
        session_id = body.session_id
        self.store.require(SessionRow, session_id, "session")
        sampling_id = f"{session_id}:sample:{body.sampling_session_seq_id}"
        if self.store.get(SamplingSessionRow, sampling_id) is not None:
            return sampling_id
        model_path, base_model = body.model_path, body.base_model
        if model_path:
            run_id, kind, _ = parse_tinker_path(model_path)
            if kind != "sampler":
                raise UserError(
                    f"{model_path} is a training checkpoint; sample from a sampler checkpoint "
                    "(save_weights_for_sampler) instead"
                )
            self.store.require_checkpoint(model_path, "sampler checkpoint")
            base_model = self._run_base_model(run_id)
            row = SamplingSessionRow(
                id=sampling_id,
                session_id=session_id,
                base_model=base_model,
                model_path=model_path,
                source="path",
            )
        else:
            self.base_models.get(base_model)
            row = SamplingSessionRow(
                id=sampling_id, session_id=session_id, base_model=str(base_model), source="base"
            )
        self.store.add(row)
        return sampling_id

    def get_sampler(self, sampling_id: str) -> dict[str, Any]:
        row = self.store.require(SamplingSessionRow, sampling_id, "sampler")
        return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}

    # ---------------------------------------------------------------- sampling
    @staticmethod
    def check_request(body: SampleBody) -> int:
        """Refuse a sample request's bad sizes at once (a 400; counts, top-k and the target
        tensor's shape are bounded by the body's type); returns num_samples."""
        _targets(body.target_prompt_logprobs)
        return body.num_samples

    def _run_base_model(self, run_id: str) -> str:
        return str(self.store.require(ModelRow, run_id, "training run").base_model)

    def _target(self, body: SampleBody) -> tuple[str, BaseModelInfo]:
        """The weights tag a sample request names and its base model (blocking: reads records)."""
        sampling_id = body.sampling_session_id
        if sampling_id:
            row = self.store.require(SamplingSessionRow, sampling_id, "sampling session")
            info = self.base_models.get(row.base_model)
            tag = {"base": "base", "path": row.model_path, "ephemeral": f"ephemeral:{row.id}"}[row.source]
            return str(tag), info
        if body.model_path:
            path = body.model_path
            run_id, _, _ = parse_tinker_path(path)
            return path, self.base_models.get(self._run_base_model(run_id))
        return "base", self.base_models.get(body.base_model)

    def _vocab_size(self, info: BaseModelInfo) -> int:
        """Blocking the first time (it reads the model's config file)."""
        if info.path not in self.vocab:
            from transformers import AutoConfig

            self.vocab[info.path] = int(AutoConfig.from_pretrained(info.path).get_text_config().vocab_size)
        return self.vocab[info.path]

    async def sample(self, body: SampleBody, request_id: str) -> bytes:
        """The `SampleResponse` of one sample request (sequence ids `<request_id>:<i>`)."""
        tag, info = await asyncio.to_thread(self._target, body)
        record_session = await asyncio.to_thread(self._record_session, body)
        chunks = body.prompt.chunks
        loop = asyncio.get_running_loop()
        parts = await loop.run_in_executor(self.media, json_parts, chunks, "prompt", self.media_roots)
        with_images = any(isinstance(p, ImageInput) for p in parts)
        host = self.host(info)
        if with_images:
            if not host.vision:
                raise UserError(f"{info.name} is not a vision-language model; the prompt has image chunks")
            if body.prompt_logprobs:
                raise UserError(
                    "prompt_logprobs for prompts with images are not supported by this server yet"
                )
            await host.prefetch(await self._loader(tag, info))  # the engine renders from now on
            prompt = (await self.render_hosts.get(info.path).render_parts(parts)).tokens
        else:
            prompt = [t for p in parts if not isinstance(p, ImageInput) for t in p]
        if not prompt:
            raise UserError("prompt is empty")
        vocab = await asyncio.to_thread(self._vocab_size, info)
        check_token_range(prompt, vocab, "prompt")
        num = body.num_samples
        if body.prompt_alt_tokens_k:
            raise UserError("prompt_alt_tokens_k is not supported by this server")
        prompt_k, sample_k = body.topk_prompt_logprobs or 0, body.topk_sample_logprobs or 0
        targets = _targets(body.target_prompt_logprobs)
        if targets is not None and targets.shape[0] != len(prompt) - 1:
            raise UserError(
                f"target_prompt_logprobs has {targets.shape[0]} rows; the prompt of {len(prompt)} tokens "
                f"needs {len(prompt) - 1} (row i scores position i + 1)"
            )
        if with_images and (prompt_k or targets is not None):
            raise UserError("top-k and target prompt logprobs for prompts with images are not supported")
        if targets is not None:
            check_token_range(targets[targets >= 0].tolist(), vocab, "target_prompt_logprobs")
        params = to_engine_params(body.sampling_params, len(prompt), info.max_model_len, num)
        params.top_logprobs = sample_k
        want_plp = bool(body.prompt_logprobs)
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise UserError(f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}], got {last_n}")
        async with self.gate(info).slot(current_user.get()):
            if with_images:
                result = await host.sample_images(await self._loader(tag, info), parts, params)
            else:
                scores = PromptScores(logprobs=want_plp, topk=prompt_k, targets=targets)
                result = await host.sample(await self._loader(tag, info), prompt, params, scores)
        plp, topk_prompt = result.prompt_logprobs, result.topk_prompt
        if last_n is not None:
            cut = len(prompt) - last_n
            if plp is not None:
                plp = [math.nan] * cut + plp[cut:]
            if topk_prompt is not None:
                topk_prompt = [None] * cut + topk_prompt[cut:]
        if record_session is not None:
            sampling = sampled_distribution(params.temperature, params.top_k, params.top_p, params.min_p)
            for i, seq in enumerate(result.sequences):
                self.records.add(f"{request_id}:{i}", record_session, seq.tokens, seq.logprobs, sampling)
        return encode_sample_response(
            result.sequences,
            plp,
            topk_prompt,
            result.target_prompt,
            prompt_k=prompt_k,
            sample_k=sample_k,
            prompt_cache_hit_tokens=result.prompt_cached_tokens,
        )

    def _record_session(self, body: SampleBody) -> str | None:
        """The session whose stability records this request adds to (None: it records nothing;
        blocking: reads the sampler's record)."""
        if not body.record_stability_info:
            return None
        row = self.store.get(SamplingSessionRow, str(body.sampling_session_id))
        if row is None:
            raise UserError("record_stability_info needs a sampling client created by a session")
        return str(row.session_id)

    async def asample(self, body: SampleBody, idem: str | None) -> tuple[str, list[str]]:
        """(request id, sequence ids) of a sample request, submitted through the request path."""
        num = self.check_request(body)
        sampling_id, seq = body.sampling_session_id, body.seq_id
        keys = [
            f"sample:{sampling_id}:{seq}" if sampling_id and seq is not None else None,
            f"idem:{idem}" if idem else None,
        ]

        async def prepare(request_id: str) -> Work:
            return lambda: self.sample(body, request_id)

        request_id = await self.requests.submit("sample", None, keys, prepare)
        return request_id, [f"{request_id}:{i}" for i in range(num)]
