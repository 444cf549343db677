"""Where a promotion that landed ranks in vLLM 0.32's CPU tier: as recent as its landing, and
its tail evicted before its head, as vLLM 0.33 ranks it.

vLLM 0.32's LRU policy ranks a chunk by when it was allocated. A promotion allocates a request's
prefix one lookup at a time, in order, at the step the request is looked up; its chunks are
written while the step's stores allocate more recent ones, and once the read landed they are
idle until their request is scheduled, a step or more later. Chunks vLLM stores meanwhile evict
the least recently used first: the promoted prefix's *first* chunk. vLLM's scan of a prefix
stops at its first miss, so the request then recomputes whole, and every read of that promotion
was wasted (serve-bench, 16 requests at once, an 8 MiB CPU tier: 1.1 to 1.3 chunks read per
chunk used). vLLM 0.33 ranks a request's chunks by their position in it, tail first ("tails
precede heads", its ``LRUCachePolicy``), so a loss costs a request its last chunks.

On vLLM 0.32 with the LRU policy, :func:`landed_ranker` gives ``RemoteHostTier`` a function to
call on a promotion's landed chunks before vLLM hears of them (``get_finished_jobs``, and so
before vLLM marks them evictable): it touches them in the primary tier, vLLM's own
``OffloadingManager.touch``, which ranks a prefix's head most recent. On 0.33, and with another
eviction policy, there is nothing to do and it returns ``None``.

Threading: the function runs where vLLM collects the tier's finished jobs, under its tiering
manager's lock (``remote_tier``'s module docstring). It reaches the primary tier through the
spec that built the tier (vLLM 0.32 keeps its manager as ``_manager``); when it is not there
(another vLLM build), ranking is skipped and logged once.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import vllm
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

logger = logging.getLogger(__name__)

RankLanded = Callable[[ReqContext, Sequence[OffloadKey]], None]


def ranks_by_allocation(version: str = vllm.__version__) -> bool:
    """Whether this vLLM's LRU policy ranks a chunk by its allocation (before 0.33)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) < (0, 33)


def landed_ranker(spec: Any) -> RankLanded | None:
    """The function that ranks a landed promotion (module docstring), or ``None`` when vLLM
    ranks it so itself: 0.33 and later, or a primary tier with another eviction policy."""
    if not ranks_by_allocation():
        return None
    if getattr(spec, "eviction_policy", None) != "lru" or getattr(
        spec, "cache_policy_module_path", None
    ):
        return None
    owner = weakref.ref(spec)  # the spec owns vLLM's manager, which owns the tier
    missing: list[bool] = []

    def rank_landed(req_context: ReqContext, keys: Sequence[OffloadKey]) -> None:
        primary = getattr(getattr(owner(), "_manager", None), "primary_tier", None)
        if primary is None:
            if not missing:
                missing.append(True)
                logger.warning(
                    "RemoteHostTier: vLLM's CPU tier is not reachable from its spec; promoted "
                    "chunks keep vLLM's ranking (head evicted first)"
                )
            return
        primary.touch(_in_prefix_order(req_context, keys), req_context)

    return rank_landed


def _in_prefix_order(req_context: ReqContext, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """``keys`` by their position in the request, when vLLM recorded every one; else as given
    (the order vLLM looked them up in, which is the prefix's)."""
    positions = [req_context.get_offload_key_position(key) for key in keys]
    if None in positions:
        return list(keys)
    order = sorted(range(len(keys)), key=cast(list[int], positions).__getitem__)
    return [keys[i] for i in order]


__all__ = ["RankLanded", "landed_ranker", "ranks_by_allocation"]
