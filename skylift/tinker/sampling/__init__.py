"""Sampling: sampling sessions and samples over lazily started inference engines, the weights a
sampler samples from (full, LoRA adapters and in-memory snapshots), with its router and bodies."""
