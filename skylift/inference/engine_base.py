"""`EngineBase`: what every skylift engine client does the same way before its transport.

`LocalVLLMEngine` (vLLM in this process) and `RemoteInferenceEngine` (a skylift server over HTTP)
share the interface's front: `generate` checks the request once here and hands it to the
transport's `_generate`; `prompt_logprobs` is one teacher-forced `generate` for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skylift.inference.types import EngineRequestError, GenerateOutput, SamplingParams, score_sequences


@dataclass
class GenerateCall:
    """One checked `generate` request, as a transport receives it."""

    prompts: list[list[int]]  # none empty
    params: SamplingParams
    session_id: str | None
    prompt_logprobs: bool
    images: Sequence[list[Any] | None] | None  # one list per prompt, or None
    lora_name: str | None


class EngineBase:
    """The shared front of an engine client; a subclass names itself (`name`) and implements
    `_generate` (prompts non-empty, one image list per prompt)."""

    name: str

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        session_id: str | None = None,
        *,
        prompt_logprobs: bool = False,
        images: Sequence[list[Any] | None] | None = None,
        lora_name: str | None = None,
    ) -> list[GenerateOutput]:
        """Sample `params.n` continuations of every prompt (token ids in, token ids out).

        `prompt_logprobs` also scores every prompt token (`GenerateOutput.prompt_logprobs`).
        `images`: per prompt, the PIL images its image placeholder tokens stand for (a vision
        model's; the output's prompt is then vLLM's, placeholders expanded). `session_id` goes
        with each request (routing by session is the pool's concern). `lora_name`: the LoRA
        adapter to sample with (None: the engine's default adapter, if any; "": the base model).
        """
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineRequestError(f"{self.name}: generate: prompt {i} is empty")
        if images is not None and len(images) != len(prompts):
            raise EngineRequestError(
                f"{self.name}: generate: {len(images)} image lists for {len(prompts)} prompts"
            )
        return await self._generate(
            GenerateCall(prompts, params, session_id, prompt_logprobs, images, lora_name)
        )

    async def _generate(self, call: GenerateCall) -> list[GenerateOutput]:
        raise NotImplementedError

    async def prompt_logprobs(
        self, sequences: list[list[int]], lora_name: str | None = None
    ) -> list[list[float]]:
        """Log-probability of every token of each sequence given the tokens before it (teacher
        forcing): one value per token after the first. `lora_name` as in `generate`."""
        return await score_sequences(self, self.name, sequences, lora_name)
