"""``TierManager.create``: a tier over a fresh ``BlockArena`` registered with a new
``NixlTransport``, its arguments checked before either is made.

``TierManager`` takes ``create`` from here as its classmethod. It builds nothing shared and
holds no lock (any thread); the tier it returns owns its transport (``close`` closes it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager_args import check_flags, tier_settings
from torch_kv_tier.overdue import TRANSFER_TIMEOUT_S, Overdue

if TYPE_CHECKING:
    from torch_kv_tier.manager import TierManager

__all__ = ["create"]


def create(
    cls: type[TierManager],
    num_blocks: int,
    block_len: int,
    *,
    device: str = "cpu",
    config_fields: dict[str, Any] | None = None,
    name: str = "tier",
    max_inflight: int = 64,
    events: bool = False,
    grant_batch: int | None = None,
    verify: bool = True,
    compact_index: bool | None = None,
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
    settle_late_loads: bool = True,
) -> TierManager:
    """A tier over a fresh ``BlockArena`` registered with a ``NixlTransport``.

    A tier only initiates transfers, and its poller progresses them, so its transport runs
    without NIXL's progress thread (``passive_progress=False``), which would compete with
    the poller for the same UCX worker. At the thread limit (``RuntimeError``) it closes it.
    """
    from torch_kv_tier.transport.nixl import NixlTransport

    tier_settings(max_inflight, grant_batch, block_len)  # before memory and an agent
    check_flags(verify=verify, events=events, compact_index=compact_index)
    Overdue(transfer_timeout_s, settle_loads=settle_late_loads)  # (its checks) likewise
    arena = BlockArena(num_blocks, block_len, device=device)
    transport = NixlTransport(
        name, arena.tensor, config_fields=config_fields, passive_progress=False
    )
    try:
        return cls(
            arena,
            transport,
            max_inflight=max_inflight,
            events=events,
            grant_batch=grant_batch,
            verify=verify,
            compact_index=compact_index,
            transfer_timeout_s=transfer_timeout_s,
            settle_late_loads=settle_late_loads,
        )
    except BaseException:  # (a thread that could not start): the agent is not left behind
        transport.close()
        raise
