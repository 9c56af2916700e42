"""The pure parts of LoRA weight sync: engine arguments, the adapter's files, the receiver's RPC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from skylift.inference.engine_args import lora_engine_args
from skylift.weight_sync.lora.adapter import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    RPC_RECEIVE_LORA,
    adapter_nbytes,
    json_ready,
    vllm_max_lora_rank,
    write_adapter_dir,
)


def test_max_lora_rank_rounds_up_to_a_rank_vllm_accepts() -> None:
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 512)] == [1, 8, 8, 16, 32, 64, 512]
    with pytest.raises(ValueError, match="above the largest rank"):
        vllm_max_lora_rank(513)


def test_engine_args_enable_lora_only_for_a_lora_policy() -> None:
    assert lora_engine_args(0) == {}
    assert lora_engine_args(12) == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2}


def test_adapter_directory_is_what_peft_and_vllm_read(tmp_path: Path) -> None:
    from peft import LoraConfig
    from safetensors.torch import load_file

    config = LoraConfig(r=4, lora_alpha=8, target_modules={"q_proj", "v_proj"}).to_dict()
    tensors = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(4, 16))]
    write_adapter_dir(str(tmp_path / "a"), tensors, config)
    saved = json.loads((tmp_path / "a" / ADAPTER_CONFIG_FILE).read_text())
    assert saved["r"] == 4 and saved["target_modules"] == ["q_proj", "v_proj"]
    loaded = load_file(str(tmp_path / "a" / ADAPTER_WEIGHTS_FILE))
    assert torch.equal(loaded[tensors[0][0]], tensors[0][1])
    assert adapter_nbytes(tensors) == 4 * 16 * 4
    assert json_ready({"s": {"b", "a"}, "n": {"x": (1, 2)}}) == {"s": ["a", "b"], "n": {"x": [1, 2]}}


def test_the_worker_extension_serves_the_lora_rpc() -> None:
    from skylift.inference.vllm_worker import WeightSyncWorkerExtension

    assert callable(getattr(WeightSyncWorkerExtension, RPC_RECEIVE_LORA, None))


def test_config_refuses_a_lora_sync_path_without_lora_and_a_rank_vllm_cannot_serve() -> None:
    from skylift.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="lora_sync_path='/tmp/x' hands a LoRA adapter"):
        load_config(["generator.lora_sync_path=/tmp/x"])
    with pytest.raises(ConfigError, match="ranks up to 512"):
        load_config(["trainer.policy.model.lora.rank=1024"])
    cfg = load_config(["generator.lora_sync_path=/tmp/x", "trainer.policy.model.lora.rank=8"])
    assert cfg.generator.lora_sync_path == "/tmp/x"


def test_skyrl_lora_sync_path_key_has_the_same_effect() -> None:
    from skylift.config import ConfigError, load_config
    from skylift.weight_sync.factory import lora_sync_path

    lora = ["trainer.policy.model.lora.rank=8"]
    assert lora_sync_path(load_config(lora)) is None
    skyrl = load_config([*lora, "trainer.policy.model.lora.lora_sync_path=/shared/adapters"])
    assert lora_sync_path(skyrl) == "/shared/adapters"
    ours = load_config([*lora, "generator.lora_sync_path=/shared/adapters"])
    assert lora_sync_path(ours) == "/shared/adapters"
    both = [*lora, "generator.lora_sync_path=/a", "trainer.policy.model.lora.lora_sync_path=/a"]
    assert lora_sync_path(load_config(both)) == "/a"
    with pytest.raises(ConfigError, match="name different directories"):
        load_config([*lora, "generator.lora_sync_path=/a", "trainer.policy.model.lora.lora_sync_path=/b"])
    with pytest.raises(ConfigError, match=r"trainer.policy.model.lora.lora_sync_path='/a'.*rank is 0"):
        load_config(["trainer.policy.model.lora.lora_sync_path=/a"])
