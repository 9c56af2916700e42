"""Training operations of the Tinker API: `TrainingOperations` (the training router calls it).

create_model, get_info, forward / forward_backward, optim_step, save_weights (save_state),
load_weights (both shapes: create-from-state and the legacy load into an existing model) and
save_weights_for_sampler (named: a Hugging Face export on disk; ephemeral: an in-memory snapshot
bound to a new sampling session). None of them needs an inference engine. A named sampler save does
not start one either: recipes save sampler weights with every checkpoint of a pure SFT run (the
cookbook's `supervised.train` does), and only a sampling session is a sign that sampling will
follow; the ephemeral save creates one, so it asks the sampling side to warm up in the background.

Each operation's work runs on the model's ordered queue; its store reads and writes go through
`db` (a worker thread), never on the event loop. What the operations use is handed to the
constructor by the service that wires them (`skylift.tinker.service.TinkerService`): the store,
the served base models, the loaded models, admission, the stability records, the sampling side,
and the service's submit path, training thread, model registration and checkpoint writer.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from skylift.tinker.core.errors import UserError
from skylift.tinker.core.futures import Work
from skylift.tinker.core.wire import ForwardBackwardCall
from skylift.tinker.storage.store import CheckpointRow, ModelRow, utcnow
from skylift.tinker.storage.views import check_name, parse_tinker_path, tinker_path
from skylift.tinker.training.bodies import (
    CreateModelBody,
    LoadWeightsBody,
    LoraBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
)
from skylift.tinker.training.loss_sampling import SAMPLING_KEYS, recorded_config
from skylift.tinker.training.losses import RECORDED_LOGPROBS, SAMPLED_MASK, get_loss
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel, read_checkpoint_config

if TYPE_CHECKING:
    from skylift.tinker.core.base_models import BaseModels
    from skylift.tinker.core.provenance import StabilityRecords
    from skylift.tinker.sampling.service import SamplingService
    from skylift.tinker.storage.store import Store
    from skylift.tinker.training.admission import Admission

#: db(fn, *args): a blocking store call on a worker thread
Db = Callable[..., Awaitable[Any]]
#: run_training(fn, *args): `fn(*args)` on the one training thread, in the calling user's turn
RunTraining = Callable[..., Awaitable[Any]]
#: submit(kind, model_id, dedup_keys, prepare, queue_seq=...): record a request and run it
Submit = Callable[..., Awaitable[str]]
#: submit_model_op(kind, model_id, seq_id, fn(model), idem): queue `fn` on a loaded model
SubmitModelOp = Callable[..., Awaitable[str]]
#: render_images(model_path, data): render the image-bearing datums of a batch
RenderImages = Callable[[str, list[Any]], Awaitable[None]]
#: new_model(session_id, model_seq_id, config, user_metadata) -> (model id, model), registered
NewModel = Callable[[str, int, ModelConfig, Any], Awaitable[tuple[str, TrainedModel]]]
#: setup_work(model, (checkpoint dir, with optimizer) | None, result): the work that builds it
SetupWork = Callable[[TrainedModel, tuple[Path, bool] | None, dict[str, Any]], Work]
#: write_checkpoint(writer, model_id, kind, name, expires_at, user_metadata) -> (path, size)
WriteCheckpoint = Callable[..., Awaitable[tuple[str, int]]]


def _expiry(ttl: float | None) -> dt.datetime | None:
    return None if ttl is None else utcnow() + dt.timedelta(seconds=int(ttl))


class TrainingOperations:
    """The training operations of the Tinker API over their collaborators (see the module
    docstring); every operation answers its request id (and model id where it names one)."""

    def __init__(
        self,
        *,
        store: Store,
        base_models: BaseModels,
        models: Mapping[str, TrainedModel],
        admission: Admission,
        records: StabilityRecords,
        sampling: SamplingService,
        db: Db,
        run_training: RunTraining,
        submit: Submit,
        submit_model_op: SubmitModelOp,
        render_images: RenderImages,
        new_model: NewModel,
        setup_work: SetupWork,
        write_checkpoint: WriteCheckpoint,
    ) -> None:
        self.store = store
        self.base_models = base_models
        self.models = models  # the loaded models (the service's registry; read here)
        self.admission = admission
        self.records = records
        self.sampling = sampling
        self.db = db
        self.run_training = run_training
        self.submit = submit
        self.submit_model_op = submit_model_op
        self.render_images = render_images
        self.new_model = new_model
        self.setup_work = setup_work
        self.write_checkpoint = write_checkpoint

    # ---------------------------------------------------------------- models
    async def create_model(self, body: CreateModelBody) -> tuple[str, str]:
        """(request id, model id); the future resolves when the model is built."""
        session_id, seq = body.session_id, body.model_seq_id
        model_id = f"{session_id}:train:{seq}"

        self.admission.check(model_id, lambda: self.model_config(body))  # a 400 if it does not fit

        async def prepare(request_id: str) -> Work:
            config = self.model_config(body)
            _, model = await self.new_model(session_id, seq, config, body.user_metadata)
            return self.setup_work(model, None, {"model_id": model_id, "type": "create_model"})

        request_id = await self.submit("create_model", model_id, [f"create:{model_id}"], prepare, queue_seq=0)
        return request_id, model_id

    def model_config(self, body: CreateModelBody) -> ModelConfig:
        info = self.base_models.get(body.base_model)
        lora = body.lora_config or LoraBody()
        optimizer = body.optimizer_config.type if body.optimizer_config else "adamw"
        if optimizer != "adamw":
            raise UserError(f"optimizer {optimizer!r} is not supported; this server trains with adamw")
        config = ModelConfig(
            base_model=str(body.base_model),
            model_path=info.path,
            lora_rank=lora.rank,
            train_attn=lora.train_attn,
            train_mlp=lora.train_mlp,
            train_unembed=lora.train_unembed,
            seed=lora.seed or 0,
        )
        if config.lora_rank < 0:  # refused before a model record exists (the build checks it too)
            raise UserError(f"lora_config.rank must be >= 0 (0 = full fine-tuning), got {config.lora_rank}")
        if config.is_lora:
            config.target_modules()  # validates the choice early
        return config

    def get_info(self, model_id: str) -> dict[str, Any]:
        """Blocking (it reads the model's record)."""
        row = self.store.require(ModelRow, model_id, "model id")
        config = ModelConfig.from_json(row.config)
        info = self.base_models.find_path(config.model_path)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": info.arch if info else None,
                "model_name": row.base_model,
                "tokenizer_id": config.model_path,
            },
            "is_lora": config.is_lora,
            "lora_rank": config.lora_rank if config.is_lora else None,
            "model_name": row.base_model,
        }

    # ---------------------------------------------------------------- forward, backward, step
    def check_context(self, call: ForwardBackwardCall) -> None:
        """Refuse (a 400, before anything is queued) a datum longer than the model's context."""
        model = self.models.get(call.model_id)
        info = self.base_models.find_path(model.config.model_path) if model is not None else None
        if info is None:
            return
        for i, datum in enumerate(call.data):
            if len(datum.tokens) > info.max_model_len:
                raise UserError(
                    f"datum {i}: model_input has {len(datum.tokens)} tokens; {info.name} trains on at most "
                    f"{info.max_model_len} (the server's --max-model-len)"
                )

    async def forward_backward(self, call: ForwardBackwardCall, idem: str | None) -> str:
        kind = "forward" if call.forward_only else "forward_backward"
        self.check_context(call)

        async def fn(model: TrainedModel) -> bytes:
            if call.error is not None:
                raise call.error
            spec = get_loss(call.loss_fn)
            if spec.needs_provenance or (
                set(SAMPLING_KEYS) <= set(spec.config_keys) and any(d.loss_spans for d in call.data)
            ):
                row = await self.db(self.store.get, ModelRow, model.model_id)
                session_id = str(row.session_id)
                if spec.needs_provenance:
                    self._resolve_provenance(session_id, call)
                # the sampling parameters of the sequences the data names, where the server recorded them
                recorded = self.records.sampling_of([d.loss_spans for d in call.data], session_id)
                call.loss_fn_config = recorded_config(call.loss_fn_config, recorded)
            if any(d.needs_render for d in call.data):
                if model.image_token_id is None:  # refuse before starting a render server for nothing
                    raise UserError(
                        f"{model.config.base_model} is not a vision-language model; image chunks need one "
                        "(a Qwen2-VL-family base model)"
                    )
                await self.render_images(model.config.model_path, call.data)
            return await self.run_training(model.forward_backward, call)

        return await self.submit_model_op(kind, call.model_id, call.seq_id or None, fn, idem)

    def _resolve_provenance(self, session_id: str, call: ForwardBackwardCall) -> None:
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
            recorded, sampled = self.records.resolve(
                datum.loss_spans, targets.astype(np.int64), advantages, session_id, where
            )
            datum.inputs[RECORDED_LOGPROBS], datum.inputs[SAMPLED_MASK] = recorded, sampled

    async def optim_step(self, body: OptimStepBody, idem: str | None) -> str:
        params = body.params()

        async def fn(model: TrainedModel) -> dict[str, Any]:
            if params.get("type", "adamw") not in ("adamw", "adam"):
                raise UserError(f"optimizer {params.get('type')!r} is not supported; send adam_params")
            params.pop("type", None)
            metrics = await self.run_training(model.optim_step, params)
            return {"metrics": metrics, "type": "optim_step"}

        return await self.submit_model_op("optim_step", body.model_id, body.seq_id, fn, idem)

    # ---------------------------------------------------------------- saving and loading
    async def save_weights(self, body: SaveWeightsBody, idem: str | None) -> str:
        model_id = body.model_id

        async def fn(model: TrainedModel) -> dict[str, Any]:
            name = check_name(body.path, "save_weights")
            path = tinker_path(model_id, "training", name)
            if await self.db(self.store.checkpoint, path) is not None and not body.overwrite:
                raise UserError(f"checkpoint {path} already exists; pass overwrite=True to replace it")
            expiry = _expiry(body.ttl_seconds)
            await self.write_checkpoint(
                model.save_state, model_id, "training", name, expiry, body.user_metadata
            )
            return {"path": path, "type": "save_weights"}

        return await self.submit_model_op("save_weights", model_id, body.seq_id, fn, idem)

    async def save_weights_for_sampler(self, body: SaveWeightsForSamplerBody, idem: str | None) -> str:
        model_id, name, seq = body.model_id, body.path, body.sampling_session_seq_id

        async def named(model: TrainedModel) -> dict[str, Any]:
            checked = check_name(name, "save_weights_for_sampler")
            path = tinker_path(model_id, "sampler", checked)
            expiry = _expiry(body.ttl_seconds)
            await self.write_checkpoint(
                model.export_sampler, model_id, "sampler", checked, expiry, body.user_metadata
            )
            return {"path": path, "type": "save_weights_for_sampler"}

        async def ephemeral(model: TrainedModel) -> dict[str, Any]:
            row = await self.db(self.store.get, ModelRow, model_id)
            sampling_id = f"{row.session_id}:sample:{seq}"
            weights = await self.run_training(model.snapshot_sampler)  # LoRA: the adapter only
            await self.sampling.bind_ephemeral(sampling_id, row.session_id, model, weights)
            return {"sampling_session_id": sampling_id, "type": "save_weights_for_sampler"}

        fn = named if name is not None else ephemeral
        if name is None and seq is None:

            async def fn(model: TrainedModel) -> dict[str, Any]:
                raise UserError("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")

        return await self.submit_model_op("save_weights_for_sampler", model_id, body.seq_id, fn, idem)

    def _training_checkpoint(self, path: str) -> tuple[CheckpointRow, ModelConfig]:
        """The training checkpoint at `path` and the model config saved with it (blocking)."""
        _, kind, _ = parse_tinker_path(path)
        if kind != "training":
            raise UserError(
                f"{path} is a sampler checkpoint; load_weights needs a training checkpoint (…/weights/…)"
            )
        row = self.store.require_checkpoint(path)
        return row, read_checkpoint_config(Path(row.directory))

    async def load_weights(self, body: LoadWeightsBody, idem: str | None) -> tuple[str, str | None]:
        """(request id, model id). With `session_id` a new model is created from the checkpoint."""
        path, optimizer = body.path, body.optimizer
        if body.session_id is None:
            model_id = str(body.model_id)

            async def fn(model: TrainedModel) -> dict[str, Any]:
                row, saved = await self.db(self._training_checkpoint, path)
                mine = model.config
                if (saved.model_path, saved.lora_rank) != (mine.model_path, mine.lora_rank):
                    raise UserError(
                        f"checkpoint {path} is for {saved.base_model} with LoRA rank {saved.lora_rank}; "
                        f"model {model_id} is {mine.base_model} with rank {mine.lora_rank}"
                    )
                await self.run_training(model.load_state, Path(row.directory), optimizer)
                return {"path": path, "model_id": model_id, "type": "load_weights"}

            return await self.submit_model_op("load_weights", model_id, body.seq_id, fn, idem), model_id

        session_id, seq = body.session_id, body.model_seq_id
        model_id = f"{session_id}:train:{seq}"
        # a 400 now when the new client would not fit (a missing checkpoint fails the future below)
        await self.db(self.admission.check, model_id, lambda: self._training_checkpoint(path)[1])

        async def prepare(request_id: str) -> Any:
            row, config = await self.db(self._training_checkpoint, path)
            if body.base_model:
                info = self.base_models.get(body.base_model)
                if info.path != config.model_path:
                    raise UserError(
                        f"base_model {body.base_model!r} does not match the checkpoint's {config.base_model!r}"
                    )
                config.base_model = body.base_model
            else:
                self.base_models.get(config.base_model)
            _, model = await self.new_model(session_id, seq, config, body.user_metadata)
            result = {"path": path, "model_id": model_id, "type": "load_weights"}
            return self.setup_work(model, (Path(row.directory), optimizer), result)

        request_id = await self.submit("load_weights", model_id, [f"create:{model_id}"], prepare, queue_seq=0)
        return request_id, model_id
