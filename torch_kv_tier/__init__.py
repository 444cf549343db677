"""torch_kv_tier: a PyTorch KV-cache offload tier over NIXL."""

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.results import PeerStats, TierEvent, TierStats, TransferResult
from torch_kv_tier.transport import DataTransport, NixlTransport, PollResult

__all__ = [
    "BlockArena",
    "DataTransport",
    "NixlTransport",
    "PeerStats",
    "PollResult",
    "TierEvent",
    "TierManager",
    "TierStats",
    "TransferResult",
]
__version__ = "0.1.0"
