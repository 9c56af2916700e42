"""What the LoRA weight-sync tests share: the adapter's rank, the scored sequences, the policy's side."""

from __future__ import annotations

import torch

from skylift.cluster.worker_group import RLWorker

SEQUENCES = [[5, 17, 230, 999, 42, 8, 77, 301, 12, 64], [900, 3, 3, 64, 512, 1000, 12]]
RANK = 8
TOLERANCE = 1e-3  # the bound in fp32 (measured: ~1e-6)


def perturb_adapter(worker: RLWorker, seed: int) -> None:
    """Random adapter weights (PEFT starts lora_B at zero: the adapter would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in worker.model.named_parameters():  # type: ignore[union-attr]
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def adapter_bytes(worker: RLWorker) -> int:
    return sum(
        p.numel() * p.element_size()
        for n, p in worker.model.named_parameters()  # type: ignore[union-attr]
        if "lora_" in n
    )


def trainer_logprobs(worker: RLWorker, tokens: list[int]) -> list[float]:
    model = worker.model
    assert model is not None
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, tok].item() for i, tok in enumerate(tokens) if i > 0]
