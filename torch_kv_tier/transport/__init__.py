"""Data-plane transports: the ``DataTransport`` contract and its NIXL implementation."""

from torch_kv_tier.transport.base import (
    BlockRegion,
    CancelMode,
    DataTransport,
    PollResult,
    config_fingerprint,
)
from torch_kv_tier.transport.nixl import NixlTransport

__all__ = [
    "BlockRegion",
    "CancelMode",
    "DataTransport",
    "NixlTransport",
    "PollResult",
    "config_fingerprint",
]
