"""Full weights over a weight-update group, both halves: the trainer's rank 0 packs and
broadcasts buckets (`broadcaster`, `stream`; `sender`: both halves in one process), each engine's
workers receive and load them (`receiver`, `direct_load`, `fused_staging`). The transports:
`transport.BroadcastTransport` (a policy's ranks as the source) and `tensors.TensorsTransport`
(tensors held in this process: the Tinker sampler's)."""
