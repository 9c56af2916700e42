"""Item moe: the tiny Qwen3-MoE (`skylift models`: 8 experts, top-2, 4 layers) on the device.

Three parts, each compared with the same on CPU (the reference phase):
- policy steps of `TrainingWorker` (item 1's step: fp32, bf16 mixed precision, bf16 weights), and
  the same with each row carrying the routing an engine returned (`row_inputs`, routing replay:
  the CPU model's own routing with every other token sent to other experts, the last token not
  routed), calibrated for bf16 as item 1 is;
- the fused experts converted to the checkpoint's names and layouts (`checkpoint_names`, what the
  engines load): from the device's tensors the same names, shapes and bits as from the same
  tensors on CPU, and the loaded model's equal to the checkpoint file;
- a forward with replayed routing (`routing_replay`) on the real weights and on weights whose
  routers score every expert the same (all ties: the device's top-k orders ties its own way), in
  fp32 and bf16: logprobs equal to CPU's, and the experts the routers picked equal to the given
  ones (0 differences; tokens given -1 keep the device's own pick).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gpucheck.device import Context, device_type, peak_label
from gpucheck.models import SEED
from gpucheck.policy import batch_for, compare, policy_step, settings_for, strip
from gpucheck.report import Item, limit_for, max_abs
from skylift.models.checkpoint_names import checkpoint_names_for, checkpoint_tensor_names
from skylift.worker.batch import SequenceBatch
from skylift.worker.routing_replay import (
    ROUTED_EXPERTS,
    batch_routing,
    moe_routers,
    replay_routing,
    replayed,
    routing_of,
)

MODEL = "tiny-qwen3-moe"
STEPS = ("fp32", "bf16-mixed", "bf16")  # item 1's configurations (policy.CONFIGS)
REPLAY_STEPS = ("fp32", "bf16-mixed")  # the same with the rows' routing replayed
CALIBRATED_BY = {"bf16-mixed": "fp32", "bf16": "fp32"}
FORWARDS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def moe_dir() -> Path:
    from skylift.models import prepare_model

    return prepare_model(MODEL)


def vocab_size(path: Path) -> int:
    import json

    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def _load(path: Path, dtype: torch.dtype, device: str, tied: bool = False) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if tied:  # every router scores every expert the same: each top-k is all ties
        for router in moe_routers(model).values():
            router.weight.data.zero_()
    return model


def engine_routing(own: Tensor, num_experts: int) -> Tensor:
    """A routing as an engine might return it: `own` ([tokens, layers, k]) with every other token
    sent to the next experts, the last token not routed (-1)."""
    other = own.clone()
    other[1::2] = (own[1::2] + 1) % num_experts
    other[-1] = -1
    return other


def _row_ids(batch: SequenceBatch, i: int) -> Tensor:
    return batch.input_ids[i][batch.attention_mask[i].bool()]


def routed_batch(batch: SequenceBatch, routing: list[Tensor]) -> SequenceBatch:
    out = batch.with_extras()
    out.row_inputs = [{ROUTED_EXPERTS: r} for r in routing]
    return out


def forward_ids(vocab_size: int) -> Tensor:
    g = torch.Generator().manual_seed(SEED + 7)
    return torch.randint(3, vocab_size, (2, 24), generator=g)


def forward_logprobs(model: Any, ids: Tensor) -> Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0].cpu()


def replay_forward(path: Path, dtype: torch.dtype, tied: bool, ids: Tensor, given: Tensor) -> dict[str, Any]:
    """The routers' own picks, the picks and logprobs with `given` replayed, on this device."""
    model = _load(path, dtype, device_type(), tied)
    ids = ids.to(device_type())
    started = time.perf_counter()
    own = routing_of(model, input_ids=ids)
    with replay_routing(model, given):
        picked = routing_of(model, input_ids=ids)
        logprobs = forward_logprobs(model, ids)
    return {"own": own, "picked": picked, "lp": logprobs, "seconds": time.perf_counter() - started}


def converted(model: Any, path: Path) -> dict[str, Tensor]:
    """The model's tensors under its checkpoint's names (the weight sync's conversion), as
    `skylift.cluster.worker_group` converts them."""
    names = checkpoint_names_for(model, str(path))
    return dict(names.convert(model.state_dict().items()))


def layout(tensors: dict[str, Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors.items()]


# ---------------------------------------------------------------- reference (CPU)
def reference(ctx: Context) -> dict[str, Any]:
    path = moe_dir()
    refs: dict[str, Any] = {}
    model = _load(path, torch.float32, "cpu")
    if len(moe_routers(model)) != int(model.config.num_hidden_layers):
        import transformers

        raise RuntimeError(
            f"routing replay patches transformers 5's MoE top-k routers; {type(model).__name__} under "
            f"transformers {transformers.__version__} has {len(moe_routers(model))} of its layers' routers"
        )
    experts = int(model.config.num_experts)
    batch = batch_for(int(model.config.vocab_size))
    routing = [
        engine_routing(routing_of(model, input_ids=_row_ids(batch, i)[None]), experts)
        for i in range(batch.batch_size)
    ]
    ids = forward_ids(int(model.config.vocab_size))
    given = engine_routing(routing_of(model, input_ids=ids), experts)
    g = torch.Generator().manual_seed(SEED + 8)  # ties: any two distinct experts per token and layer
    tie_given = torch.stack(
        [torch.randperm(experts, generator=g)[:2] for _ in range(given.shape[0] * given.shape[1])]
    )
    tie_given = tie_given.reshape(given.shape)
    tie_given[-1] = -1  # not routed: the device's own pick among ties
    conv = converted(model, path)
    from safetensors.torch import load_file

    disk = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    refs["moe/inputs"] = {"routing": routing, "ids": ids, "given": given, "tie_given": tie_given}
    refs["moe/layout"] = layout(conv)
    refs["moe/layout_vs_file"] = max((max_abs(conv[n], disk[n]) for n in conv), default=0.0)
    del model
    for tag, config, rows in _steps(batch, routing):
        started = time.perf_counter()
        result = policy_step(settings_for(path, config), rows)
        result.pop("_worker").shutdown()
        refs[f"moe/{tag}"] = strip(result)
        print(f"  cpu reference moe/{tag}: {time.perf_counter() - started:.1f} s", flush=True)
    for tag, dtype, tied, want in _forwards(given, tie_given):
        refs[f"moe/forward/{tag}"] = replay_forward(path, dtype, tied, ids, want)
    return refs


def _steps(batch: SequenceBatch, routing: list[Tensor]) -> list[tuple[str, str, SequenceBatch]]:
    rows = routed_batch(batch, routing)
    return [(c, c, batch) for c in STEPS] + [(f"replay-{c}", c, rows) for c in REPLAY_STEPS]


def _forwards(given: Tensor, tie_given: Tensor) -> list[tuple[str, torch.dtype, bool, Tensor]]:
    return [
        (f"{tie}{name}", dtype, tied, tie_given if tied else given)
        for name, dtype in FORWARDS.items()
        for tie, tied in (("", False), ("ties-", True))
    ]


# ---------------------------------------------------------------- the device
def item_moe(ctx: Context, refs: dict[str, Any], item: Item) -> None:
    path = moe_dir()
    inputs = refs["moe/inputs"]
    batch = batch_for(vocab_size(path))
    _check_file_layout(item, path, refs)
    for tag, config, rows in _steps(batch, inputs["routing"]):
        started = time.perf_counter()
        got = policy_step(settings_for(path, config), rows)
        worker = got.pop("_worker")
        try:
            cal_tag = CALIBRATED_BY.get(config)
            cal = refs[f"moe/{tag.replace(config, cal_tag)}"] if cal_tag else None
            compare(item, f"moe/{tag}", got, refs[f"moe/{tag}"], cal)
            if cal is not None:  # the calibration itself: bf16 vs fp32, both on CPU
                drift = max_abs(refs[f"moe/{tag}"]["lp0"], cal["lp0"])
                item.figures[f"moe/{tag} vs float32 on CPU: logprobs max |diff|"] = round(drift, 6)
            item.figures[f"moe/{tag} {peak_label()}"] = got["peak_mb"]
            if rows.row_inputs is not None:
                _check_worker_replay(item, tag, worker, rows)
            _check_conversion(item, tag, worker.model, path, refs["moe/layout"])
        finally:
            worker.shutdown()
        item.figures[f"moe/{tag} seconds"] = round(time.perf_counter() - started, 2)
    for tag, dtype, tied, want in _forwards(inputs["given"], inputs["tie_given"]):
        _check_forward(item, tag, replay_forward(path, dtype, tied, inputs["ids"], want), refs, want)


def _check_file_layout(item: Item, path: Path, refs: dict[str, Any]) -> None:
    """The loaded model's tensors, converted on the device: the checkpoint file's, bit for bit."""
    from safetensors.torch import load_file

    model = _load(path, torch.float32, device_type())
    conv = converted(model, path)
    disk = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    item.holds("conversion on CPU: the checkpoint file's tensors", refs["moe/layout_vs_file"] == 0.0)
    item.holds(
        "conversion of the loaded model on the device: the checkpoint's names",
        sorted(conv) == sorted(checkpoint_tensor_names(path) or ()),
        f"{len(conv)} tensors",
    )
    item.holds("conversion on the device: names, shapes, dtypes of CPU's", layout(conv) == refs["moe/layout"])
    worst = max((max_abs(conv[n], disk[n]) for n in conv if n in disk), default=float("inf"))
    item.at_most("conversion on the device vs the checkpoint file, max |diff|", worst, 0.0)
    item.holds("conversion stays on the device", all(t.device.type == device_type() for t in conv.values()))
    item.figures["checkpoint tensors (fused experts unfused)"] = len(conv)


def _check_conversion(item: Item, tag: str, model: Any, path: Path, ref_layout: list[Any]) -> None:
    """After the step: the device's tensors convert to the same names, shapes and bits as the same
    tensors on CPU."""
    dev = converted(model, path)
    cpu = dict(
        checkpoint_names_for(model, str(path)).convert(
            (n, t.detach().cpu()) for n, t in model.state_dict().items()
        )
    )
    item.holds(
        f"moe/{tag}: converted names and shapes from the device = from CPU", layout(dev) == layout(cpu)
    )
    item.holds(
        f"moe/{tag}: converted names and shapes = the CPU reference's",
        [(n, s) for n, s, _ in layout(dev)] == [(n, s) for n, s, _ in ref_layout],
    )
    worst = max((max_abs(dev[n], cpu[n]) for n in dev if n in cpu), default=float("inf"))
    item.at_most(f"moe/{tag}: converted values from the device vs from CPU, max |diff|", worst, 0.0)


def _check_worker_replay(item: Item, tag: str, worker: Any, rows: SequenceBatch) -> None:
    """The worker's padded forward routes every given (token, layer) as given."""
    model = worker.model
    on = rows.to(worker.device)
    want = batch_routing(rows)
    assert want is not None
    with replayed(model, on):
        picked = routing_of(model, input_ids=on.input_ids, attention_mask=on.attention_mask)
    given = want >= 0
    diff = int((picked[given] != want[given]).sum())
    item.at_most(f"moe/{tag}: padded batch, routed experts differing from the given ones", diff, 0)
    item.figures[f"moe/{tag}: replayed (token, layer) pairs"] = int(given.all(-1).sum())


def _check_forward(item: Item, tag: str, got: dict[str, Any], refs: dict[str, Any], given: Tensor) -> None:
    ref = refs[f"moe/forward/{tag}"]
    routed = given >= 0
    missing = ~routed
    wrong = int((got["picked"][routed] != given[routed]).sum())
    item.at_most(f"forward/{tag}: replayed experts differing from the given ones", wrong, 0)
    # a token given -1 keeps the router's own pick; in layer 0 (whose input no replay changes)
    # that is the pick of the forward without replay, on the same device
    first = missing[:, 0]
    own_kept = int((got["picked"][:, 0][first] != got["own"][:, 0][first]).sum())
    item.at_most(f"forward/{tag}: tokens given -1, layer 0 experts differing from the own pick", own_kept, 0)
    unrouted = int((got["picked"][missing] != ref["picked"][missing]).sum())
    item.figures[f"forward/{tag}: tokens given -1, experts differing from CPU's"] = unrouted
    cal = None
    if tag.endswith("bf16"):  # calibrated by the same forward in fp32 on CPU
        cal = max_abs(ref["lp"], refs[f"moe/forward/{tag.replace('bf16', 'fp32')}"]["lp"])
    item.at_most(
        f"forward/{tag}: logprobs with replayed routing, max |diff|",
        max_abs(got["lp"], ref["lp"]),
        limit_for("logprobs_abs", cal),
    )
    own_diff = int((got["own"] != ref["own"]).any(-1).sum())
    pairs = int(got["own"].shape[0] * got["own"].shape[1])
    item.figures[f"forward/{tag}: own routing, (token, layer) pairs differing from CPU"] = (
        f"{own_diff} of {pairs}"
    )
    item.figures[f"forward/{tag} seconds"] = round(got["seconds"], 3)


__all__ = ["item_moe", "reference"]
