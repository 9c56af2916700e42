"""What the LoRA weight-sync tests share: the adapter's rank, the scored sequences, the policy's side."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skylift.cluster.worker_group import RLWorker, WorkerGroup
from skylift.weight_sync.lora.transport import LoraPolicySync
from skylift.worker.training_worker import WorkerSettings

SEQUENCES = [[5, 17, 230, 999, 42, 8, 77, 301, 12, 64], [900, 3, 3, 64, 512, 1000, 12]]
RANK = 8
TOLERANCE = 1e-3  # the bound in fp32 (measured: ~1e-6)


@dataclass
class LoraPolicy:
    """A LoRA policy rank in this process and the driver's side of its weight sync (what the
    trainer's `EngineWeights` runs), over the real engines."""

    worker: RLWorker
    link: LoraPolicySync
    run: Callable[..., Any]

    @property
    def model(self) -> torch.nn.Module | None:
        return self.worker.model

    def sync_weights(self, lora_sync_path: str | None = None) -> dict[str, float]:
        return self.run(self.link.push(None, lora_sync_path))  # type: ignore[no-any-return]

    def lora_adapter(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        return self.worker.lora_adapter()


@contextmanager
def lora_policy(
    model_dir: Path,
    loop: Any,
    engines: Sequence[Any],
    override_existing: bool,
    master_address: str | None = "127.0.0.1",
) -> Iterator[LoraPolicy]:
    """A LoRA policy (adapter perturbed with seed 1) in a weight-update group with `engines`."""
    group = WorkerGroup(
        "policy", WorkerSettings(model_path=str(model_dir), lora_rank=RANK, lora_alpha=16), use_ray=False
    )
    group.setup()
    link = LoraPolicySync(group, backend="gloo", timeout_s=60.0, master_address=master_address)
    policy = LoraPolicy(group.workers[0], link, loop.run)
    perturb_adapter(policy, seed=1)
    loop.run(link.open(engines, override_existing=override_existing))
    try:
        yield policy
    finally:
        loop.run(link.close())


def perturb_adapter(worker: RLWorker | LoraPolicy, seed: int) -> None:
    """Random adapter weights (PEFT starts lora_B at zero: the adapter would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in worker.model.named_parameters():  # type: ignore[union-attr]
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def adapter_bytes(worker: RLWorker | LoraPolicy) -> int:
    return sum(
        p.numel() * p.element_size()
        for n, p in worker.model.named_parameters()  # type: ignore[union-attr]
        if "lora_" in n
    )


def trainer_logprobs(worker: RLWorker | LoraPolicy, tokens: list[int]) -> list[float]:
    model = worker.model
    assert model is not None
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, tok].item() for i, tok in enumerate(tokens) if i > 0]


def max_error(engine: Any, loop: Any, policy: LoraPolicy, lora_name: str | None = None) -> float:
    """The largest gap between `engine`'s teacher-forced logprobs of `SEQUENCES` (with adapter
    `lora_name`) and the trainer's."""

    async def engine_logprobs() -> list[list[float]]:
        from skylift.inference.types import TEACHER_FORCING, teacher_forced_logprobs

        outputs = await engine.generate(SEQUENCES, TEACHER_FORCING, prompt_logprobs=True, lora_name=lora_name)
        return teacher_forced_logprobs(repr(engine), outputs)

    got = loop.run(engine_logprobs())
    return max(
        abs(a - b)
        for seq, lps in zip(SEQUENCES, got, strict=True)
        for a, b in zip(lps, trainer_logprobs(policy, seq), strict=True)
    )
