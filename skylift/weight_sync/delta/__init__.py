"""Checkpoint-delta weight sync, both halves: the policy's rank 0 publishes the changed tensors of
each version (`publish`, in the layout of `format`, to object storage through `cloud`), each
engine host applies them to its store (`apply`) and its workers load them (`receiver`); the
transport: `transport.DeltaTransport`."""
