"""The checks of a ``TierManager``'s region, sizes and switches, made before anything is
built: the constructor's before its poller starts, ``TierManager.create``'s before it allocates
an arena or starts a NIXL agent.

Each raises ``TypeError``/``ValueError`` naming the bad argument; none has state (any thread).
"""

from __future__ import annotations

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.remote.quantities import count, flag
from torch_kv_tier.shared_host import MAX_GRANT, default_grant_batch
from torch_kv_tier.transport.base import DataTransport

__all__ = ["check_flags", "check_region", "tier_settings"]


def check_region(arena: BlockArena, transport: DataTransport) -> None:
    """``ValueError`` unless ``transport``'s region is ``arena``: as many blocks, as long."""
    if (arena.num_blocks, arena.block_len) != (transport.num_blocks, transport.block_len):
        raise ValueError(
            f"arena {arena.num_blocks} x {arena.block_len} does not match the transport's "
            f"region {transport.num_blocks} x {transport.block_len}: build the transport "
            "over arena.tensor"
        )


def tier_settings(max_inflight: int, grant_batch: int | None, block_len: int) -> tuple[int, int]:
    """``max_inflight`` and the grant batch a tier of blocks of ``block_len`` bytes uses
    (``None``: the default), as ints (``quantities.count``: numpy's taken; a grant request
    carries the batch to the host); ``TypeError``/``ValueError`` naming one out of range."""
    max_inflight = count("max_inflight", max_inflight)
    if grant_batch is None:
        grant_batch = default_grant_batch(block_len)
    grant_batch = count("grant_batch", grant_batch)
    if grant_batch > MAX_GRANT:
        raise ValueError(f"grant_batch must be in [1, {MAX_GRANT}], got {grant_batch}")
    return max_inflight, grant_batch


def check_flags(*, verify: bool, events: bool, compact_index: bool | None) -> None:
    """``TypeError`` naming the first of a tier's switches that is no ``bool`` (``compact_index``:
    or ``None``, the default by size): ``verify="no"`` was true (``quantities.flag``)."""
    flag("verify", verify)
    flag("events", events)
    if compact_index is not None:
        flag("compact_index", compact_index)
