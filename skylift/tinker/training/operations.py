"""Training operations of the Tinker API (each queued on the model's ordered queue).

forward / forward_backward, optim_step, save_weights (save_state), load_weights (both shapes:
create-from-state and the legacy load into an existing model) and save_weights_for_sampler
(named: a Hugging Face export on disk; ephemeral: an in-memory snapshot bound to a new sampling
session). None of them needs an inference engine. A named sampler save does not start one either:
recipes save sampler weights with every checkpoint of a pure SFT run (the cookbook's
`supervised.train` does), and only a sampling session is a sign that sampling will follow; the
ephemeral save creates one, so it asks the sampling side to warm up in the background.

Each `fn` runs on the model's ordered queue; its store reads and writes go through `svc.db`
(a worker thread), never on the event loop.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

import numpy as np

from skylift.tinker.checkpoints.operations import write_checkpoint
from skylift.tinker.core.errors import UserError
from skylift.tinker.core.wire import ForwardBackwardCall
from skylift.tinker.storage.store import CheckpointRow, ModelRow, utcnow
from skylift.tinker.storage.views import check_name, parse_tinker_path, tinker_path
from skylift.tinker.training.bodies import (
    LoadWeightsBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
)
from skylift.tinker.training.loss_sampling import SAMPLING_KEYS, recorded_config
from skylift.tinker.training.losses import RECORDED_LOGPROBS, SAMPLED_MASK, get_loss
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel, read_checkpoint_config

if TYPE_CHECKING:
    from skylift.tinker.service import TinkerService


def check_context(svc: TinkerService, call: ForwardBackwardCall) -> None:
    """Refuse (a 400, before anything is queued) a datum longer than the model's context."""
    model = svc.models.get(call.model_id)
    info = svc.base_models.find_path(model.config.model_path) if model is not None else None
    if info is None:
        return
    for i, datum in enumerate(call.data):
        if len(datum.tokens) > info.max_model_len:
            raise UserError(
                f"datum {i}: model_input has {len(datum.tokens)} tokens; {info.name} trains on at most "
                f"{info.max_model_len} (the server's --max-model-len)"
            )


async def forward_backward(svc: TinkerService, call: ForwardBackwardCall, idem: str | None) -> str:
    kind = "forward" if call.forward_only else "forward_backward"
    check_context(svc, call)

    async def fn(model: TrainedModel) -> bytes:
        if call.error is not None:
            raise call.error
        spec = get_loss(call.loss_fn)
        if spec.needs_provenance or (
            set(SAMPLING_KEYS) <= set(spec.config_keys) and any(d.loss_spans for d in call.data)
        ):
            row = await svc.db(svc.store.get, ModelRow, model.model_id)
            session_id = str(row.session_id)
            if spec.needs_provenance:
                _resolve_provenance(svc, session_id, call)
            # the sampling parameters of the sequences the data names, where the server recorded them
            recorded = svc.records.sampling_of([d.loss_spans for d in call.data], session_id)
            call.loss_fn_config = recorded_config(call.loss_fn_config, recorded)
        if any(d.needs_render for d in call.data):
            if model.image_token_id is None:  # refuse before starting a render server for nothing
                raise UserError(
                    f"{model.config.base_model} is not a vision-language model; image chunks need one "
                    "(a Qwen2-VL-family base model)"
                )
            await svc.render_images(model.config.model_path, call.data)
        return await svc.run_training(model.forward_backward, call)

    return await svc.submit_model_op(kind, call.model_id, call.seq_id or None, fn, idem)


def _resolve_provenance(svc: TinkerService, session_id: str, call: ForwardBackwardCall) -> None:
    """Fill in the recorded sampler logprobs and sampled-position mask of every datum (from the
    stability records of the model's session)."""
    for i, datum in enumerate(call.data):
        where = f"datum {i}"
        if not datum.loss_spans:
            raise UserError(
                f"{where}: loss {call.loss_fn!r} needs provenance (Datum.with_provenance naming the "
                "sequence_ids of a sampler created with record_stability_info=True)"
            )
        targets, advantages = datum.inputs.get("target_tokens"), datum.inputs.get("advantages")
        if targets is None or advantages is None or targets.ndim != 1:
            raise UserError(f"{where}: {call.loss_fn} needs 1-D target_tokens and advantages")
        recorded, sampled = svc.records.resolve(
            datum.loss_spans, targets.astype(np.int64), advantages, session_id, where
        )
        datum.inputs[RECORDED_LOGPROBS], datum.inputs[SAMPLED_MASK] = recorded, sampled


async def optim_step(svc: TinkerService, body: OptimStepBody, idem: str | None) -> str:
    params = body.params()

    async def fn(model: TrainedModel) -> dict[str, Any]:
        if params.get("type", "adamw") not in ("adamw", "adam"):
            raise UserError(f"optimizer {params.get('type')!r} is not supported; send adam_params")
        params.pop("type", None)
        metrics = await svc.run_training(model.optim_step, params)
        return {"metrics": metrics, "type": "optim_step"}

    return await svc.submit_model_op("optim_step", body.model_id, body.seq_id, fn, idem)


def _expiry(ttl: float | None) -> dt.datetime | None:
    return None if ttl is None else utcnow() + dt.timedelta(seconds=int(ttl))


async def save_weights(svc: TinkerService, body: SaveWeightsBody, idem: str | None) -> str:
    model_id = body.model_id

    async def fn(model: TrainedModel) -> dict[str, Any]:
        name = check_name(body.path, "save_weights")
        path = tinker_path(model_id, "training", name)
        if await svc.db(svc.store.checkpoint, path) is not None and not body.overwrite:
            raise UserError(f"checkpoint {path} already exists; pass overwrite=True to replace it")
        expiry = _expiry(body.ttl_seconds)
        await write_checkpoint(svc, model.save_state, model_id, "training", name, expiry, body.user_metadata)
        return {"path": path, "type": "save_weights"}

    return await svc.submit_model_op("save_weights", model_id, body.seq_id, fn, idem)


async def save_weights_for_sampler(
    svc: TinkerService, body: SaveWeightsForSamplerBody, idem: str | None
) -> str:
    model_id, name, seq = body.model_id, body.path, body.sampling_session_seq_id

    async def named(model: TrainedModel) -> dict[str, Any]:
        checked = check_name(name, "save_weights_for_sampler")
        path = tinker_path(model_id, "sampler", checked)
        expiry = _expiry(body.ttl_seconds)
        await write_checkpoint(
            svc, model.export_sampler, model_id, "sampler", checked, expiry, body.user_metadata
        )
        return {"path": path, "type": "save_weights_for_sampler"}

    async def ephemeral(model: TrainedModel) -> dict[str, Any]:
        row = await svc.db(svc.store.get, ModelRow, model_id)
        sampling_id = f"{row.session_id}:sample:{seq}"
        c = model.config
        with_full = svc.sampling.wants_full(c.model_path, c.lora_rank, c.train_unembed)
        weights = await svc.run_training(model.snapshot_sampler, with_full)
        await svc.sampling.bind_ephemeral(sampling_id, row.session_id, model, weights)
        return {"sampling_session_id": sampling_id, "type": "save_weights_for_sampler"}

    fn = named if name is not None else ephemeral
    if name is None and seq is None:

        async def fn(model: TrainedModel) -> dict[str, Any]:
            raise UserError("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")

    return await svc.submit_model_op("save_weights_for_sampler", model_id, body.seq_id, fn, idem)


def _training_checkpoint(svc: TinkerService, path: str) -> tuple[CheckpointRow, ModelConfig]:
    """The training checkpoint at `path` and the model config saved with it (blocking)."""
    _, kind, _ = parse_tinker_path(path)
    if kind != "training":
        raise UserError(
            f"{path} is a sampler checkpoint; load_weights needs a training checkpoint (…/weights/…)"
        )
    row = svc.store.require_checkpoint(path)
    return row, read_checkpoint_config(svc.store_path(row))


async def load_weights(svc: TinkerService, body: LoadWeightsBody, idem: str | None) -> tuple[str, str | None]:
    """(request id, model id). With `session_id` a new model is created from the checkpoint."""
    path, optimizer = body.path, body.optimizer
    if body.session_id is None:
        model_id = str(body.model_id)

        async def fn(model: TrainedModel) -> dict[str, Any]:
            row, saved = await svc.db(_training_checkpoint, svc, path)
            mine = model.config
            if (saved.model_path, saved.lora_rank) != (mine.model_path, mine.lora_rank):
                raise UserError(
                    f"checkpoint {path} is for {saved.base_model} with LoRA rank {saved.lora_rank}; "
                    f"model {model_id} is {mine.base_model} with rank {mine.lora_rank}"
                )
            await svc.run_training(model.load_state, svc.store_path(row), optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return await svc.submit_model_op("load_weights", model_id, body.seq_id, fn, idem), model_id

    session_id, seq = body.session_id, body.model_seq_id
    model_id = f"{session_id}:train:{seq}"
    # a 400 now when the new client would not fit (a missing checkpoint fails the future below)
    await svc.db(svc.admission.check, model_id, lambda: _training_checkpoint(svc, path)[1])

    async def prepare(request_id: str) -> Any:
        row, config = await svc.db(_training_checkpoint, svc, path)
        if body.base_model:
            info = svc.base_models.get(body.base_model)
            if info.path != config.model_path:
                raise UserError(
                    f"base_model {body.base_model!r} does not match the checkpoint's {config.base_model!r}"
                )
            config.base_model = body.base_model
        else:
            svc.base_models.get(config.base_model)
        _, model = await svc.new_model(session_id, seq, config, body.user_metadata)
        result = {"path": path, "model_id": model_id, "type": "load_weights"}
        return svc.setup_work(model, (svc.store_path(row), optimizer), result)

    request_id = await svc.submit("load_weights", model_id, [f"create:{model_id}"], prepare, queue_seq=0)
    return request_id, model_id
