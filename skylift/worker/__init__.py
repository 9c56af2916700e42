"""The training worker: the policy/reference/critic model on one rank (FSDP2) and the tensors it consumes."""
