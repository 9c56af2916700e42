"""Protocol semantics: losses, user errors, metric keys, de-duplication, sessions."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker_helpers import datum, logprobs_of, sft_dataset

pytestmark = pytest.mark.integration

TOKENS = [5 + (j * 5) % 37 for j in range(16)]


@pytest.fixture
def training_client(service_client):
    return service_client.create_lora_training_client(base_model="tiny-qwen2", rank=4).result()


def _lp(tc) -> np.ndarray:
    return logprobs_of(tc.forward([datum(TOKENS)], "cross_entropy").result())


def test_cross_entropy_accepts_negative_weights(training_client) -> None:
    lp = _lp(training_client)
    weights = np.linspace(-1.0, 1.0, len(TOKENS) - 1).astype(np.float32)
    out = training_client.forward([datum(TOKENS, weights=weights)], "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(float(-(lp * weights).sum()), rel=1e-4, abs=1e-4)


def _rl_datum(old: np.ndarray, adv: float) -> types.Datum:
    n = len(TOKENS) - 1
    return datum(TOKENS, logprobs=old.astype(np.float32), advantages=np.full(n, adv, dtype=np.float32))


def test_policy_losses_match_their_definitions(training_client) -> None:
    tc = training_client
    lp = _lp(tc)
    old = lp - 1.0  # ratio e ~ 2.72 on every token
    is_loss = tc.forward([_rl_datum(old, 0.5)], "importance_sampling").result().metrics["loss:sum"]
    assert is_loss == pytest.approx(float(-(np.exp(lp - old) * 0.5).sum()), rel=1e-4)
    n = len(lp)
    ppo = tc.forward([_rl_datum(old, 1.0)], "ppo").result().metrics["loss:sum"]
    assert ppo == pytest.approx(-1.2 * n, rel=1e-4)  # clipped at the default 1.2
    ppo_wide = tc.forward(
        [_rl_datum(old, 1.0)], "ppo", loss_fn_config={"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    ).result()
    assert ppo_wide.metrics["loss:sum"] == pytest.approx(-1.5 * n, rel=1e-4)
    assert all(":" in key for key in ppo_wide.metrics)
    cispo = tc.forward([_rl_datum(old, 1.0)], "cispo").result().metrics["loss:sum"]
    assert cispo == pytest.approx(float(-(1.2 * lp).sum()), rel=1e-4)


def test_gradients_accumulate_across_calls_until_optim_step(service_client) -> None:
    """Two half-batches then one step == one full batch then one step (same init seed)."""
    data = sft_dataset()
    a = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=4, seed=7).result()
    b = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=4, seed=7).result()
    a.forward_backward(data, "cross_entropy").result()
    b.forward_backward(data[:2], "cross_entropy").result()
    b.forward_backward(data[2:], "cross_entropy").result()
    for tc in (a, b):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_allclose(_lp(a), _lp(b), atol=1e-5)


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("build", "loss", "needle"),
    [
        (lambda: [datum(TOKENS)], "no_such_loss", "unknown loss_fn"),
        (
            lambda: [
                types.Datum(
                    model_input=types.ModelInput.from_ints(TOKENS),
                    loss_fn_inputs={"target_tokens": np.array([1, 2], dtype=np.int64)},
                )
            ],
            "cross_entropy",
            "has shape",
        ),
        (lambda: [datum(TOKENS)], "ppo", "needs loss_fn_inputs"),
        (
            lambda: [
                types.Datum(
                    model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                    loss_fn_inputs={},
                )
            ],
            "cross_entropy",
            "datum 0 chunk 0: cannot decode the png image",
        ),
        (
            lambda: [
                types.Datum(
                    model_input=types.ModelInput(chunks=[types.ImageChunk(data=_png(), format="png")]),
                    loss_fn_inputs={},
                )
            ],
            "cross_entropy",
            "tiny-qwen2 is not a vision-language model",
        ),
        (lambda: [datum([5, 6, 10**6])], "cross_entropy", "outside the vocabulary"),
    ],
)
def test_bad_requests_are_user_errors(service_client, build, loss, needle) -> None:
    tc = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=4).result()
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward(build(), loss).result()
    assert info.value.category == tinker.types.RequestErrorCategory.User
    assert needle in str(info.value)


def test_unknown_base_model_is_a_user_error(service_client) -> None:
    with pytest.raises(tinker.RequestFailedError) as info:
        service_client.create_lora_training_client(base_model="no/such-model", rank=4).result()
    assert info.value.category == tinker.types.RequestErrorCategory.User
    assert "not served here" in str(info.value)


def _post(url: str, route: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{route}", headers={"X-API-Key": "tml-dummy"}, timeout=60, **kw)


def _result(url: str, request_id: str) -> httpx.Response:
    while True:
        resp = _post(url, "retrieve_future", json={"request_id": request_id})
        if resp.status_code != 408:
            return resp


def test_futures_dedup_unknown_ids_and_sessions(tinker_server, training_client) -> None:
    url = tinker_server.url
    model_id = training_client.model_id
    body = {"model_id": model_id, "seq_id": 1000, "adam_params": {"learning_rate": 0.0}, "type": "optim_step"}
    first, second = _post(url, "optim_step", json=body), _post(url, "optim_step", json=body)
    assert first.status_code == 200 and first.json()["request_id"] == second.json()["request_id"]
    assert "grad_norm" in _result(url, first.json()["request_id"]).json()["metrics"]

    unknown = _post(url, "optim_step", json={**body, "model_id": "nope:train:0", "seq_id": 1})
    failed = _result(url, unknown.json()["request_id"]).json()
    assert failed["category"] == "user" and "unknown model id" in failed["error"]
    assert _post(url, "retrieve_future", json={"request_id": "req-missing"}).status_code == 404

    session_id = _post(
        url, "create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}
    ).json()["session_id"]
    assert _post(url, "session_heartbeat", json={"session_id": session_id}).status_code == 200
    assert (
        _post(url, f"sessions/{session_id}/finish", json={"reason": {"type": "success"}}).status_code == 200
    )
    assert _post(url, "session_heartbeat", json={"session_id": session_id}).status_code == 410
