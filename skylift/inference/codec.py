"""The JSON of skylift's token-level generation route, both ways (server and client share it).

A request: ``{"prompt_token_ids": [[...]], "sampling_params": {...}, "prompt_logprobs": bool,
"session_id"?: str, "images"?: [[base64 image file...]]}`` (images: `skylift.inference.image_wire`). An answer: ``{"model", "weight_version", "outputs": [output...]}`` with one
output per prompt: ``{"prompt_token_ids", "prompt_logprobs", "completions": [{"token_ids",
"logprobs", "stop_reason", "matched_stop", "text", "token_versions"}]}``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

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
    return asdict(output)


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
            )
            for c in data["completions"]
        ],
        prompt_logprobs=None if plp is None else list(plp),
    )
