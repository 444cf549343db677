"""Landed promotions held in vLLM's CPU tier until their request is scheduled.

A promotion's chunks land in vLLM's CPU primary tier a step or more before their request is
scheduled, and vLLM marks them evictable as soon as it hears of the read (``complete_write``):
until the request's own ``prepare_load`` pins them, every other request's stores evict them
whenever the CPU tier has no other idle chunk, and the read was wasted (with an 8 MiB tier at
concurrency 16, 85 to 89 % of the promoted chunks lost went so; README, "Under load").

:class:`PromotionPins` holds them with the CPU tier's own eviction protection: the reference
count vLLM's tiering manager takes while a secondary tier reads a chunk (``prepare_read`` and
``complete_read`` of its primary tier). vLLM handles each finished job a tier reports before it
asks the tier for the next one, and may allocate for a store right after the last, in the same
call (``prepare_store`` polls first); so the tier reports its finished jobs one at a time
(:meth:`PromotionPins.reported`) and pins what landed as soon as vLLM marked it ready, before
anything else runs. A request's chunks are released once it is scheduled (vLLM's
``prepare_load`` holds them from there; ``on_schedule_end`` says so), preempted or finished,
and every one when vLLM drains the tier to reset its CPU tier (which then empties it); from the
drain to the step's end nothing is pinned. A store that finds no idle chunk is refused, and vLLM
retries it at the next step. The pins stay within the promotion budget
(``tier_sizing.promotion_budget``: admission keeps a promise in it until vLLM loaded it), so at
least half of the CPU tier stays for stores. A request resumed after a preemption is not among
the step's new requests: what was promoted for it since is released when it finishes.

Threading: none of its own; every method is called under vLLM's manager lock
(``remote_tier``'s module docstring). It reaches the CPU tier through the spec that built the
tier (vLLM keeps its manager as ``_manager``); where it is not there (another vLLM build),
nothing is pinned and that is logged once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult

logger = logging.getLogger(__name__)


class PromotionPins:
    """Pins landed promotions until their request is scheduled; see the module docstring.

    Args:
        spec: the ``OffloadingSpec`` that built the tier (held weakly: it owns the tier).
    """

    def __init__(self, spec: Any) -> None:
        self._owner = weakref.ref(spec)
        self._landed: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}
        self._pinned: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}
        self._unreachable_logged = False
        self._draining = False  # vLLM drains the tier to reset its CPU tier: pin nothing

    @property
    def held(self) -> int:
        """Chunks pinned now."""
        return sum(len(keys) for _, keys in self._pinned.values())

    def landed(self, req_context: ReqContext, keys: Sequence[OffloadKey]) -> None:
        """A promotion's ``keys`` landed; vLLM has not heard yet (they are pinned once it
        marked them ready)."""
        self._landed.setdefault(req_context.req_id, (req_context, []))[1].extend(keys)

    def end_step(self, scheduled: Collection[str], preempted: Collection[str]) -> None:
        """Release the requests the step ``scheduled`` or ``preempted``; pin what landed for
        the others and is ready (a result vLLM took in a list before handling it), and forget
        what is not (evicted meanwhile)."""
        self.release(scheduled)
        self.release(preempted)
        self._draining = False
        self._pin_ready()
        self._landed.clear()

    def reported(self, results: list[JobResult]) -> Iterator[JobResult]:
        """``results`` one by one, pinning what landed as vLLM marks it ready: vLLM's tiering
        manager handles each finished job (``complete_write``) before it asks for the next, and
        may allocate for a store right after the last, in the same call."""
        for result in results:
            yield result
            self._pin_ready()

    def _pin_ready(self) -> None:
        if not self._landed or self._draining:
            return
        primary = self._primary()
        if primary is None:
            self._landed.clear()
            return
        for req_id, (req_context, keys) in list(self._landed.items()):
            ready = [k for k in keys if primary.lookup(k, req_context) is LookupResult.HIT]
            if not ready:
                continue
            primary.prepare_read(ready, req_context)
            self._pinned.setdefault(req_id, (req_context, []))[1].extend(ready)
            pinned = set(ready)
            waiting = [k for k in keys if k not in pinned]
            if waiting:
                self._landed[req_id] = (req_context, waiting)
            else:
                del self._landed[req_id]

    def release(self, req_ids: Collection[str]) -> None:
        """Unpin (and forget) what is held for ``req_ids``."""
        for req_id in req_ids:
            self._landed.pop(req_id, None)
            pinned = self._pinned.pop(req_id, None)
            if pinned is not None:
                self._unpin(*pinned)

    def release_all(self) -> None:
        """Unpin everything and pin nothing until the step ends: vLLM drains the tier before
        it resets its CPU tier, and reports the drained jobs right before the reset."""
        self.release(list(self._pinned))
        self._draining = True

    def _unpin(self, req_context: ReqContext, keys: list[OffloadKey]) -> None:
        primary = self._primary()
        if primary is not None:
            primary.complete_read(keys, req_context)

    def _primary(self) -> Any:
        primary = getattr(getattr(self._owner(), "_manager", None), "primary_tier", None)
        if primary is None and not self._unreachable_logged:
            self._unreachable_logged = True
            logger.warning(
                "RemoteHostTier: vLLM's CPU tier is not reachable from its spec; landed "
                "promotions are not held until their request is scheduled"
            )
        return primary


__all__ = ["PromotionPins"]
