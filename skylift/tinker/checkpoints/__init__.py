"""Checkpoints out and in: external weights and signed URLs, publishing, TTLs, copies, weights
info, the metadata file beside every checkpoint, with its router and bodies."""
