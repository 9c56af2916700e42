"""A Tinker LoRA client over a mixture-of-experts base (the tiny recipes): what its adapter covers,
said in one line at create time (the experts through PEFT's ``target_parameters``, never the
routers) or refused where the experts cannot be adapted; its sampler weights (the named export
and the ephemeral snapshot) hold the experts' deltas under the checkpoint's names, scoring as the
training forward does; and how its samplers are served (weight swaps; ``adapters`` refused)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from skylift.models import prepare_model
from skylift.tinker.core.wire import ForwardBackwardCall, WireDatum
from skylift.tinker.errors import UserError
from skylift.tinker.sampling.lora_mode import MOE_SWAP, fixed_swap
from skylift.tinker.training.moe_lora import expert_adaptation
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel

ROWS = [[5 + (i * 7 + j * 3) % 40 for j in range(16)] for i in range(3)]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("moe_cache")
    return {name: prepare_model(name, cache_dir=cache) for name in ("tiny-qwen3-moe", "tiny-mixtral")}


def _datum(tokens: list[int]) -> WireDatum:
    n = len(tokens) - 1
    inputs = {"target_tokens": np.asarray(tokens[1:], dtype=np.int64), "weights": np.ones(n, np.float32)}
    return WireDatum(tokens=tokens[:-1], inputs=inputs)


def _scores(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0]


def _loaded(base_dir: Path, tensors: dict[str, torch.Tensor], tmp: Path) -> torch.nn.Module:
    """A fresh model from `base_dir`'s config with `tensors` (checkpoint names) as its checkpoint."""
    for item in base_dir.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            (tmp / item.name).write_bytes(item.read_bytes())
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), {"format": "pt"}
    )
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def _set_up(name: str, model_dir: Path, caplog: pytest.LogCaptureFixture) -> tuple[TrainedModel, str]:
    """A rank-4 LoRA client with Tinker's default targets, and its create-time line."""
    model = TrainedModel("m", ModelConfig(base_model=name, model_path=str(model_dir), lora_rank=4))
    with caplog.at_level(logging.INFO, logger="skylift.tinker.training.trained_model"):
        model.setup()
    line = next(r.getMessage() for r in caplog.records if "mixture of experts" in r.getMessage())
    assert "fused down_proj at rank 4 and gate_up_proj at rank 8 per expert" in line, line
    assert "q_proj" in line and "lm_head" in line and "routers are not adapted" in line
    return model, line


def test_mixtral_experts_are_adapted_by_their_own_names(
    moe_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = _set_up("tiny-mixtral", moe_dirs["tiny-mixtral"], caplog)  # w1/w3, w2: PEFT's mapping
    model.close()


def test_a_trained_moe_adapter_samples_as_it_trains(
    moe_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = "tiny-qwen3-moe"
    model, _ = _set_up(name, moe_dirs[name], caplog)
    for step in range(2):
        call = ForwardBackwardCall("m", step, "cross_entropy", False, [_datum(r) for r in ROWS])
        model.forward_backward(call)
        model.optim_step({"learning_rate": 1e-2})
    worker = model.worker
    assert worker is not None
    with torch.no_grad():
        trained = _scores(worker._model(), ROWS[0])
    snapshot = model.snapshot_sampler()
    assert snapshot.adapter is not None and snapshot.full is not None  # merged on the trainer
    assert any(".experts.0." in k for k in snapshot.full)  # the checkpoint's per-expert names
    (tmp_path / "snap").mkdir()
    swapped = _scores(_loaded(moe_dirs[name], snapshot.full, tmp_path / "snap"), ROWS[0])
    model.export_sampler(tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(moe_dirs[name], dtype=torch.float32).eval()
    assert (_scores(base, ROWS[0]) - trained).abs().max() > 0.1  # training moved the scores
    assert (swapped - trained).abs().max() < 1e-4
    assert (_scores(exported, ROWS[0]) - trained).abs().max() < 1e-4
    model.save_state(tmp_path / "state")  # a training checkpoint: the experts' adapters come back
    resumed = TrainedModel("r", model.config, pool=model.pool)
    resumed.setup()
    resumed.load_state(tmp_path / "state", optimizer=True)
    assert resumed.worker is not None
    torch.testing.assert_close(_scores(resumed.worker._model(), ROWS[0]), trained, rtol=0, atol=1e-6)
    resumed.close()
    model.close()


def test_attention_only_adapters_keep_the_tensors_only_merge(moe_dirs: dict[str, Path]) -> None:
    config = ModelConfig("tiny-qwen3-moe", str(moe_dirs["tiny-qwen3-moe"]), lora_rank=4, train_mlp=False)
    model = TrainedModel("m", config)
    model.setup()
    snapshot = model.snapshot_sampler()
    assert snapshot.adapter is not None and snapshot.full is None  # merged into the base on demand
    model.close()


def test_experts_left_unadapted_are_refused_when_train_mlp_asks_for_them(moe_dirs: dict[str, Path]) -> None:
    base = AutoModelForCausalLM.from_pretrained(moe_dirs["tiny-mixtral"], dtype=torch.float32)
    attention = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(UserError, match="cannot adapt the fused experts of MixtralForCausalLM") as err:
        expert_adaptation(attention, train_mlp=True)
    assert "\n" not in str(err.value) and "train_mlp=False" in str(err.value)
    said = expert_adaptation(attention, train_mlp=False)
    assert "linear layers q_proj/v_proj" in said and "no experts" in said


def test_moe_samplers_take_weight_swaps_and_adapters_are_refused() -> None:
    assert fixed_swap("m", moe=True, vision=False, flag="auto") == MOE_SWAP
    assert fixed_swap("m", moe=True, vision=False, flag="swap") == MOE_SWAP
    assert fixed_swap("m", moe=False, vision=True, flag="adapters") == "a vision-language engine"
    assert fixed_swap("m", moe=False, vision=False, flag="adapters") is None
    with pytest.raises(
        SystemExit, match="refused: --sampler-lora adapters with m, a mixture-of-experts"
    ) as err:
        fixed_swap("m", moe=True, vision=False, flag="adapters")
    assert "\n" not in str(err.value) and "--sampler-lora swap or auto" in str(err.value)


def test_adapters_on_an_moe_base_are_refused_before_anything_is_on_disk(
    moe_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skylift.tinker.commands import main, refuse_sampler_lora

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data"
    base = str(moe_dirs["tiny-qwen3-moe"])
    argv = ["serve", "--base-model", base, "--sampler-lora", "adapters", "--data-dir", str(data)]
    with pytest.raises(SystemExit, match="refused: --sampler-lora adapters with .*mixture-of-experts") as err:
        main([*argv, "--port", "1"])  # refused before the port is bound, too
    assert "\n" not in str(err.value)
    assert not data.exists() and list(tmp_path.iterdir()) == []  # no data dir, no database
    refuse_sampler_lora([base], None, "swap")  # swaps and auto start (the server goes on)
    refuse_sampler_lora(["no-such-model-is-read"], None, "auto")  # configs read only for adapters
