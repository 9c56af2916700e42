"""`EngineChatClient`: the policy's own engines as an environment's `skylift.envs.llm.LLMClient`."""

from __future__ import annotations

from typing import Any

from skylift.generator.chat import ChatFormat
from skylift.inference.types import InferenceEngine, SamplingParams


class EngineChatClient:
    """Chat with the policy's engines (e.g. a user simulator played by the policy itself): the
    messages rendered with the chat template, one sample, the reply decoded without special tokens."""

    def __init__(self, engine: InferenceEngine, chat: ChatFormat, max_prompt_tokens: int) -> None:
        self.engine = engine
        self.chat_format = chat
        self.max_prompt_tokens = max_prompt_tokens

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> str:
        ids = self.chat_format.prompt_ids(messages)
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"llm prompt has {len(ids)} tokens, more than {self.max_prompt_tokens}")
        params = SamplingParams(
            temperature=float(sampling.pop("temperature", 0.0)),
            max_tokens=int(sampling.pop("max_tokens", 256)),
            top_p=float(sampling.pop("top_p", 1.0)),
            seed=sampling.pop("seed", None),
            stop=sampling.pop("stop", None),
            logprobs=False,
        )
        if sampling:
            raise ValueError(f"unknown sampling fields {sorted(sampling)}")
        out = await self.engine.generate([ids], params)
        completion = out[0].completions[0]
        return str(self.chat_format.tokenizer.decode(completion.token_ids, skip_special_tokens=True))

    async def close(self) -> None:
        """Nothing to release: the engines belong to the trainer."""
