"""Weight sync: new weights into running inference engines without restarting them.

One interface per half: the driver's (`transport.WeightTransport`, picked from a run's config by
`factory.make_transport`) and the engine's (`engine_side.EngineSide`, reached through every engine
client's one `weight_call(transport, operation, payload)`; `factory.ENGINE_SIDES` lists them).
Each transport in its own folder with its halves (driver, engine, worker): `broadcast/` (full
weights over a weight-update group; also `TensorsTransport`), `lora/` (a LoRA adapter), `delta/`
(changed tensors through a shared directory or bucket), `ipc/` (full weights by handle on one
host: CUDA IPC, shared memory). `topology` says which fits where the ranks are. Shared at the top:
`protocol` (wire and RPC types), `process_group` (+ `torch_group`), `buckets`, `control` (the
engines' side of a group, driven), `policy_sync` (the driver's end of a group between the policy
and the engines), `worker_side` (the workers' one generic method)."""

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
