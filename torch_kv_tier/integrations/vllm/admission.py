"""Admission of remote-tier hits into vLLM's CPU primary tier: which lookup HITs may become
promotions.

vLLM's ``TieringOffloadingManager`` turns every HIT of a secondary tier into a promotion: it
allocates a primary-tier chunk at once (evicting the least recently used idle one) and reads
the chunk there at the end of the scheduler step; a request whose prefix has a promotion in
flight is deferred to a later step, when it looks its prefix up again. With more prefix chunks
wanted than the primary tier holds (a burst of long prompts, a small ``cpu_bytes_to_use``),
that goes wrong in two ways, both seen under load (issue 19):

- promoted chunks are evicted, by the next promotions or by the chunks vLLM stores, before
  their request is scheduled; its next lookup finds them gone and promotes them again, so the
  tier reads chunks that are never used, and the request is deferred step after step;
- a chunk whose allocation fails answers MISS, but the request is still deferred for its
  other pending chunks and asks again next step.

:class:`PromotionAdmission` keeps promotions within a budget of primary chunks
(:func:`~torch_kv_tier.integrations.vllm.tier_sizing.promotion_budget`) and answers MISS for a
chunk the tier already promised to the same request in this scheduling attempt: vLLM only asks
again for a chunk its primary tier lost (allocation failed, evicted before use, promotion
failed), and reading it again would be wasted. A MISS ends vLLM's prefix scan, so the request
is served with the leading chunks it has and recomputes the rest at once. Promises are made in
lookup order, i.e. the leading chunks of a prefix first, first come first served.

The budget counts promised chunks while vLLM cannot evict them and they take CPU-tier room
from everything else: from the HIT until their read has landed (vLLM holds them as writes in
flight until then). A finished read frees its budget at once, so the next request's lookups,
in the same scheduler step, can be promoted while the promoted request is being scheduled
(promotions finish within a step; the promoted request is first in vLLM's waiting queue). A
promise whose allocation failed (vLLM never submitted it) is released at the end of the step.
A request's promises are forgotten when it is scheduled, preempted or finished.

Threading: none of its own; every method is called under vLLM's manager lock (see
:mod:`torch_kv_tier.integrations.vllm.remote_tier`), so no two run at once.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class _Attempt:
    """One request's promises since it was last scheduled."""

    promised: set[Hashable] = field(default_factory=set)  # every key answered HIT
    held: set[Hashable] = field(default_factory=set)  # promised, read not landed: in the budget
    unsubmitted: set[Hashable] = field(default_factory=set)  # promised this step, not submitted


@dataclass
class AdmissionStats:
    """Counters since the tier started (monotonic)."""

    admitted: int = 0  # lookups answered HIT
    refused_budget: int = 0  # MISS: the budget was full
    refused_repeat: int = 0  # MISS: promised before in this attempt, and lost by vLLM
    unallocated: int = 0  # promises vLLM could not allocate (never submitted)


class PromotionAdmission:
    """Budgeted, leading-chunks-first admission of promotions; see the module docstring.

    Args:
        budget_chunks: primary-tier chunks that promotions not yet landed may occupy at once
            (>= 0; 0 admits nothing).
    """

    def __init__(self, budget_chunks: int) -> None:
        if budget_chunks < 0:
            raise ValueError(f"budget_chunks must be >= 0, got {budget_chunks}")
        self.budget = budget_chunks
        self.stats = AdmissionStats()
        self._attempts: dict[str, _Attempt] = {}
        self._held = 0

    @property
    def held(self) -> int:
        """Chunks promised and not yet released."""
        return self._held

    def admit(self, req_id: str, key: Hashable) -> bool:
        """Whether a lookup of ``key`` (held by the tier) for ``req_id`` may answer HIT."""
        attempt = self._attempts.setdefault(req_id, _Attempt())
        if key in attempt.promised:
            self.stats.refused_repeat += 1
            return False
        if self._held >= self.budget:
            self.stats.refused_budget += 1
            return False
        attempt.promised.add(key)
        attempt.held.add(key)
        attempt.unsubmitted.add(key)
        self._held += 1
        self.stats.admitted += 1
        return True

    def on_submitted(self, req_id: str, keys: Iterable[Hashable]) -> None:
        """vLLM submitted a promotion of ``keys`` for ``req_id``: their allocation succeeded."""
        attempt = self._attempts.get(req_id)
        if attempt is not None:
            attempt.unsubmitted.difference_update(keys)

    def on_read(self, req_id: str, keys: Iterable[Hashable]) -> None:
        """The promotion of ``keys`` for ``req_id`` finished (landed or failed): they leave
        the budget."""
        attempt = self._attempts.get(req_id)
        if attempt is None:
            return
        for key in keys:
            if key in attempt.held:
                attempt.held.discard(key)
                self._held -= 1

    def end_step(self, scheduled: Collection[str]) -> None:
        """The scheduler step ended (after vLLM submitted its promotions): release the
        promises vLLM could not allocate, and every promise of a request it ``scheduled``."""
        for req_id in scheduled:
            self.release(req_id)
        for attempt in self._attempts.values():
            if attempt.unsubmitted:
                self.stats.unallocated += len(attempt.unsubmitted)
                self._held -= len(attempt.unsubmitted)
                attempt.held.difference_update(attempt.unsubmitted)
                attempt.unsubmitted.clear()

    def release(self, req_id: str) -> None:
        """Forget ``req_id``'s attempt (scheduled, preempted or finished)."""
        attempt = self._attempts.pop(req_id, None)
        if attempt is not None:
            self._held -= len(attempt.held)


__all__ = ["AdmissionStats", "PromotionAdmission"]
