"""Weight sync: trainer rank 0 broadcasts bucketed weights to inference-engine workers."""

from skylift.weight_sync.buckets import iter_buckets, pack_bucket, unpack_bucket
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup, create_weight_sync_group
from skylift.weight_sync.sender import DEFAULT_BUCKET_BYTES, SyncStats, WeightSender

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
