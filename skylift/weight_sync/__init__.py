"""Weight sync: new weights into running inference engines without restarting them.

One interface (`transport.WeightTransport`), picked from a run's config by `factory.make_transport`;
each transport in its own folder with both of its halves (trainer side, engine side):
`broadcast/` (full weights over a weight-update group; also `TensorsTransport`, the Tinker
sampler's), `lora/` (a LoRA adapter), `delta/` (changed tensors through a shared directory or
bucket). Shared at the top: `protocol` (wire and RPC types), `process_group` (+ `torch_group`),
`buckets`, `control` (the engines' side of a group, driven), `policy_sync` (the driver's end of a
group between the policy and the engines)."""

from skylift.weight_sync.broadcast.sender import DEFAULT_BUCKET_BYTES, SyncStats, WeightSender
from skylift.weight_sync.buckets import iter_buckets, pack_bucket, unpack_bucket
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup, create_weight_sync_group

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SyncStats",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncGroup",
    "create_weight_sync_group",
    "iter_buckets",
    "pack_bucket",
    "unpack_bucket",
]
