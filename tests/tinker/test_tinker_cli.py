"""The official `tinker` CLI, run as a subprocess against the server: checkpoint list, info,
publish/unpublish, set-ttl, download (a training checkpoint exported as external weights through
signed URLs, loaded in transformers), delete; run list and info. Plus the REST calls the CLI does
not cover: weights_info, copy_weights, sessions. None of it needs an inference engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker_helpers import datum, logprobs_of, sft_dataset

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"
TOKENS = [5 + (j * 5) % 37 for j in range(16)]


def _cli(server: Any, *args: str) -> Any:
    exe = shutil.which("tinker") or str(Path(os.sys.executable).parent / "tinker")
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": API_KEY}
    out = subprocess.run(
        [exe, "--format", "json", *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, f"tinker {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout) if out.stdout.strip() else None


@pytest.fixture(scope="module")
def trained(tinker_server: Any) -> dict[str, Any]:
    """A LoRA run trained two steps, with a training checkpoint and the logprobs it gives."""
    service = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model="tiny-qwen2", rank=4).result()
    for _ in range(2):
        tc.forward_backward(sft_dataset(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("cli-ckpt").result().path
    lp = logprobs_of(tc.forward([datum(TOKENS)], "cross_entropy").result())
    yield {"service": service, "client": tc, "path": path, "run_id": tc.model_id, "logprobs": lp}
    service.close("success").result(timeout=60)


def test_checkpoint_commands(tinker_server: Any, trained: dict[str, Any], tmp_path: Path) -> None:
    path, run_id = trained["path"], trained["run_id"]
    listed = _cli(tinker_server, "checkpoint", "list", "--run-id", run_id)
    assert path in json.dumps(listed)
    info = _cli(tinker_server, "checkpoint", "info", path)
    assert run_id in json.dumps(info)

    rest = tinker.RestClient(base_url=tinker_server.url, api_key=API_KEY)

    def checkpoint() -> types.Checkpoint:
        return next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path)

    _cli(tinker_server, "checkpoint", "publish", path)
    assert checkpoint().public
    _cli(tinker_server, "checkpoint", "unpublish", path)
    assert not checkpoint().public
    _cli(tinker_server, "checkpoint", "set-ttl", path, "--ttl", "7200")
    expires = checkpoint().expires_at
    assert expires is not None and 7000 < (expires.timestamp() - time.time()) <= 7200
    _cli(tinker_server, "checkpoint", "set-ttl", path, "--remove")
    assert checkpoint().expires_at is None

    started = time.perf_counter()
    _cli(tinker_server, "checkpoint", "download", path, "--output", str(tmp_path))
    seconds = time.perf_counter() - started
    (downloaded,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    size = sum(f.stat().st_size for f in downloaded.rglob("*") if f.is_file())
    print(f"checkpoint download: {size / 1e6:.2f} MB in {seconds:.1f} s ({path})")
    # the temporary export is gone again
    assert not any(
        c.checkpoint_type == "external" for c in rest.list_checkpoints(run_id).result().checkpoints
    )

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(downloaded)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits.float()[0]
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(lp, trained["logprobs"], atol=1e-4)

    runs = _cli(tinker_server, "run", "list")
    assert run_id in json.dumps(runs)
    run = _cli(tinker_server, "run", "info", run_id)
    assert run_id in json.dumps(run)


def test_weights_info_copy_and_sessions(tinker_server: Any, trained: dict[str, Any]) -> None:
    rest = tinker.RestClient(base_url=tinker_server.url, api_key=API_KEY)
    info = rest.get_weights_info_by_tinker_path(trained["path"]).result()
    assert info.is_lora and info.lora_rank == 4 and info.base_model == "tiny-qwen2"

    session_id = trained["service"].holder.get_session_id()
    copy = rest.copy_weights(trained["path"], "archive", ttl_seconds=3600).result()
    assert copy.startswith("tinker://copy-") and copy.endswith("/weights/cli-ckpt")
    restored = trained["service"].create_training_client_from_state(copy).result()
    lp = logprobs_of(restored.forward([datum(TOKENS)], "cross_entropy").result())
    np.testing.assert_allclose(lp, trained["logprobs"], atol=1e-5)

    assert session_id in rest.list_sessions().result().sessions
    session = rest.get_session(session_id).result()
    assert trained["run_id"] in session.training_run_ids

    _cli(tinker_server, "checkpoint", "delete", copy, "--yes")
    assert copy not in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
