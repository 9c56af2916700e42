"""How new policy weights reach running engines: one interface (`WeightTransport`), three
transports, one factory (`make_transport`). See `transports.base`."""

from skylift.weight_sync.transports.base import EngineSet, WeightTransport
from skylift.weight_sync.transports.delta import DeltaTransport
from skylift.weight_sync.transports.factory import lora_sync_path, make_transport
from skylift.weight_sync.transports.group import BroadcastTransport, LoraTransport
from skylift.weight_sync.transports.group_link import PolicySync

__all__ = [
    "BroadcastTransport",
    "DeltaTransport",
    "EngineSet",
    "LoraTransport",
    "PolicySync",
    "WeightTransport",
    "lora_sync_path",
    "make_transport",
]
