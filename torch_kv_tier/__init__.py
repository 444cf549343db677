"""torch_kv_tier: a PyTorch KV-cache offload tier over NIXL.

The public names below are imported on first use (PEP 562), so that importing a submodule
(``torch_kv_tier.remote.server``: ``torch-kv-tier serve``) does not import torch through this
package: a host with a DRAM pool never needs it. ``from torch_kv_tier import TierManager`` works
as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_kv_tier.arena import BlockArena
    from torch_kv_tier.manager import TierManager
    from torch_kv_tier.results import PeerStats, TierEvent, TierStats, TransferResult
    from torch_kv_tier.transport import DataTransport, NixlTransport, PollResult

# each name of ``__all__`` -> the module defining it
_PUBLIC = {
    "BlockArena": "torch_kv_tier.arena",
    "DataTransport": "torch_kv_tier.transport",
    "NixlTransport": "torch_kv_tier.transport",
    "PeerStats": "torch_kv_tier.results",
    "PollResult": "torch_kv_tier.transport",
    "TierEvent": "torch_kv_tier.results",
    "TierManager": "torch_kv_tier.manager",
    "TierStats": "torch_kv_tier.results",
    "TransferResult": "torch_kv_tier.results",
}

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


def __getattr__(name: str) -> Any:
    """Import the module defining public ``name`` and return it (cached in the package)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
