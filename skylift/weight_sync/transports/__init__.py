"""How new weights reach running engines: one interface (`WeightTransport`), three transports
for a policy, one factory (`make_transport`), and `TensorsTransport` for a source of tensors in
this process (the Tinker sampler's). See `transports.base`."""

from skylift.weight_sync.transports.base import EngineSet, WeightTransport
from skylift.weight_sync.transports.delta import DeltaTransport
from skylift.weight_sync.transports.factory import lora_sync_path, make_transport
from skylift.weight_sync.transports.group import BroadcastTransport, LoraTransport
from skylift.weight_sync.transports.group_link import PolicySync
from skylift.weight_sync.transports.tensors import TensorsTransport

__all__ = [
    "BroadcastTransport",
    "DeltaTransport",
    "EngineSet",
    "LoraTransport",
    "PolicySync",
    "TensorsTransport",
    "WeightTransport",
    "lora_sync_path",
    "make_transport",
]
