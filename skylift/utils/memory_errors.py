"""Out of memory: the one line a command prints when a device or host allocation fails."""

from __future__ import annotations

#: what the CPU allocator says when the host has no room (torch raises a plain RuntimeError)
CPU_ALLOCATOR_FULL = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory(exc: BaseException) -> str | None:
    """torch's allocation failure in `exc`, in its cause chain or behind a Ray error, as one line;
    None when `exc` is not one."""
    import torch

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        # torch's (CUDA) and Ray's (the node's memory monitor killed a worker) share the name
        if (
            isinstance(current, torch.OutOfMemoryError)
            or type(current).__name__ == "OutOfMemoryError"
            or CPU_ALLOCATOR_FULL in str(current)
        ):
            return _first_sentences(str(getattr(current, "cause", None) or current))
        current = getattr(current, "cause", None) or current.__cause__
    return None


def out_of_memory_line(exc: BaseException, advice: str) -> str | None:
    """What a command says when `exc` is an allocation failure (`out_of_memory`): torch's figures,
    then `advice` (the command's own keys that lower memory); None when it is not one."""
    if (memory := out_of_memory(exc)) is None:
        return None
    return f"out of memory: {memory.rstrip('.')}. {advice}"


def _first_sentences(text: str) -> str:
    """torch's message up to its advice on the allocator's settings (which follows the figures)."""
    for line in text.splitlines():
        line = line.strip()
        if "out of memory" in line.lower() or CPU_ALLOCATOR_FULL in line:
            return line.split(" If reserved but unallocated memory is large")[0].strip()
    return " ".join(text.split())[:500]
