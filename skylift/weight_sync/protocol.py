"""The weight-sync protocol both ends speak: group spec, bucket metadata, receiver RPC names.

The sender (`skylift.weight_sync.broadcast.sender`, in the trainer's rank 0) and the receiver
(`skylift.weight_sync.broadcast.receiver`, mixed into every vLLM worker) agree on these alone. Transports
(in-process `collective_rpc`, HTTP routes, Ray) carry them unchanged through one generic call,
`weight_call` (`weight_sync.engine_side`): any object with the methods of `WeightSyncTarget` can be
a sender's peer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal, Protocol

#: Names of the receiver's methods, called on every vLLM worker through ``collective_rpc``. Strings,
#: not method references: vLLM's ``collective_rpc`` takes a method name (a callable would need its
#: insecure pickle serialization). The ``skylift_`` prefix: vLLM refuses names clashing with its Worker's.
RPC_INIT_GROUP = "skylift_init_weight_update_group"
RPC_RECEIVE = "skylift_receive_weights"
RPC_DESTROY = "skylift_destroy_weight_update_group"
RPC_HAS_GROUP = "skylift_has_weight_update_group"
#: Every bucket of one sync in one call, metadata in band (`skylift.weight_sync.broadcast.stream`).
RPC_RECEIVE_STREAM = "skylift_receive_weight_stream"
#: Load tensors of an engine host's delta store (`weight_sync.delta.receiver`).
RPC_LOAD_DELTA = "skylift_load_delta"
#: Any later transport's worker half, by (transport, method, *args) (`weight_sync.worker_side`).
RPC_WORKER_CALL = "skylift_weight_rpc"

DEFAULT_GROUP_NAME = "skylift_weight_sync"

#: How the trainer built its side of a weight-update group and sends over it: "skylift" (skylift's
#: sender: skylift's store layout, a handshake, bucketed updates) or the per-tensor protocol,
#: `PER_TENSOR` on the wire (torch's process-group helper's store layout, no handshake, one tensor
#: per update; `weight_sync.torch_group`, `weight_sync.broadcast.fused_staging`).
GroupProtocol = Literal["skylift", "skyrl"]
PER_TENSOR: Final = "skyrl"


@dataclass
class WeightUpdateGroupSpec:
    """How an engine joins the trainer's weight-update process group.

    The trainer is rank 0; an engine's workers take ranks `rank_offset .. rank_offset + tp - 1`.
    `protocol`: how the trainer built its side and sends (`GroupProtocol`).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: Literal["gloo", "nccl"] = "gloo"
    override_existing: bool = False
    timeout_s: float = 120.0
    protocol: GroupProtocol = "skylift"

    def rpc_args(self) -> tuple[Any, ...]:
        """The positional arguments of the receiver's `RPC_INIT_GROUP` method."""
        return (
            self.master_address,
            self.master_port,
            self.rank_offset,
            self.world_size,
            self.group_name,
            self.backend,
            self.override_existing,
            self.timeout_s,
            self.protocol,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WeightBucket:
    """Metadata of one bucket of tensors that follows over the process group.

    Wire format: for each distinct dtype in order of first appearance in `dtypes`, rank 0
    broadcasts ONE contiguous 1-D tensor holding the flattened tensors of that dtype concatenated
    in list order. Names are Hugging Face parameter names.
    """

    names: list[str]
    dtypes: list[str]  # e.g. "float32", "bfloat16"
    shapes: list[list[int]]

    def rpc_args(self) -> tuple[Any, ...]:
        """The positional arguments of the receiver's `RPC_RECEIVE` method."""
        return (self.names, self.dtypes, self.shapes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WeightSyncTarget(Protocol):
    """What the sender needs of a peer (every engine client is one): its ranks, and the one
    generic weight call (`weight_sync.engine_side`; the group's operations are the broadcast
    transport's: ``join``, ``bucket``, ``stream``, ``leave``). Both are coroutines."""

    async def tensor_parallel_size(self) -> int: ...

    async def weight_call(
        self, transport: str, operation: str, payload: dict[str, Any] | None = None
    ) -> Any: ...


@dataclass
class DeltaSyncRequest:
    """Checkpoint-delta weight sync: bring an engine to published `version` (`weight_sync.delta.apply`).

    `sync_dir`: where the trainer publishes (a directory the engine's host reads, or an s3:// or
    gs:// URI); `local_checkpoint_dir`: the host's store (None: one under the temp dir named after
    `sync_dir`); `download_workers`: payload files downloaded at once from a URI."""

    version: int
    sync_dir: str
    local_checkpoint_dir: str | None = None
    download_workers: int = 4

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DeltaPublishSpec:
    """Where and how the policy's rank 0 publishes checkpoint-delta versions (`weight_sync.delta.publish`)."""

    sync_dir: str
    max_file_bytes: int = 1 << 30
    num_workers: int | None = None
    staging_dir: str | None = None  # a gs:// or s3:// sync_dir: where versions are written first
    rebase_interval: int | None = None  # every N-th version against the base; older ones deleted
