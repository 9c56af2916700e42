"""The JSON of skylift's token-level generation route, both ways (server and client share it).

A request: ``{"prompt_token_ids": [[...]], "sampling_params": {...}, "prompt_logprobs": bool,
"session_id"?: str, "images"?: [[base64 image file...]]}`` (images: `skylift.inference.image_wire`). An answer: ``{"model", "weight_version", "outputs": [output...]}`` with one
output per prompt: ``{"prompt_token_ids", "prompt_logprobs", "completions": [{"token_ids",
"logprobs", "stop_reason", "matched_stop", "text", "token_versions", "routed_experts"}]}``; routed
experts (routing replay) travel as ``{"shape", "dtype", "base64"}`` of the array's bytes, or null.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from skylift.inference.types import Completion, GenerateOutput, SamplingParams


def generate_request(
    prompts: list[list[int]], params: SamplingParams, *, prompt_logprobs: bool, session_id: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_token_ids": [list(p) for p in prompts],
        "sampling_params": params.to_dict(),
        "prompt_logprobs": prompt_logprobs,
    }
    if session_id is not None:
        body["session_id"] = session_id
    return body


def output_to_json(output: GenerateOutput) -> dict[str, Any]:
    data = asdict(replace(output, completions=[replace(c, routed_experts=None) for c in output.completions]))
    for c, completion in zip(data["completions"], output.completions, strict=True):
        c["routed_experts"] = _array_to_json(completion.routed_experts)
    return data


def _array_to_json(array: Any) -> dict[str, Any] | None:
    if array is None:
        return None
    a = np.ascontiguousarray(array)
    return {"shape": list(a.shape), "dtype": a.dtype.str, "base64": base64.b64encode(a.tobytes()).decode()}


def _array_from_json(data: dict[str, Any] | None) -> np.ndarray | None:
    if data is None:
        return None
    raw = base64.b64decode(data["base64"])
    return np.frombuffer(raw, dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()


def output_from_json(data: dict[str, Any]) -> GenerateOutput:
    plp = data.get("prompt_logprobs")
    return GenerateOutput(
        prompt_token_ids=list(data["prompt_token_ids"]),
        completions=[
            Completion(
                token_ids=list(c["token_ids"]),
                logprobs=None if c.get("logprobs") is None else list(c["logprobs"]),
                stop_reason=c["stop_reason"],
                text=c.get("text"),
                matched_stop=c.get("matched_stop"),
                token_versions=None if c.get("token_versions") is None else list(c["token_versions"]),
                routed_experts=_array_from_json(c.get("routed_experts")),
            )
            for c in data["completions"]
        ],
        prompt_logprobs=None if plp is None else list(plp),
        prompt_cached_tokens=int(data.get("prompt_cached_tokens") or 0),
    )
