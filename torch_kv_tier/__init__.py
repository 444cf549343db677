"""torch_kv_tier: a PyTorch KV-cache offload tier over NIXL."""

from torch_kv_tier.transport import DataTransport, NixlTransport, PollResult

__all__ = ["DataTransport", "NixlTransport", "PollResult"]
__version__ = "0.1.0"
