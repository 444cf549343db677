"""The waiting requests :class:`~torch_kv_tier.integrations.vllm.admission.PromotionAdmission`
answered MISS, in arrival order: how many of them a request's recompute would queue behind.

vLLM asks about every waiting request in one step (a request it defers costs it no token
budget), so that count is asked once per lookup of a burst: kept sorted, it costs O(log n) a
question where a scan of every such request made the step's work quadratic in the burst.

Threading: none of its own; used under vLLM's manager lock, like the admission.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple


class Arrival(NamedTuple):
    """When a request waiting to be scheduled arrived (or was preempted)."""

    step: int
    at_s: float  # on the admission's clock
    recomputed: int  # recomputes scheduled before it arrived (``PromotionAdmission``)


class MissedQueue:
    """Requests answered MISS since they were last scheduled, with the arrival each had then
    (``None``: not waiting); a request leaves it when scheduled, preempted or finished."""

    def __init__(self) -> None:
        self._arrival_of: dict[str, Arrival | None] = {}
        self._arrivals: list[Arrival] = []  # those not None, sorted

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._arrival_of

    def add(self, req_id: str, arrival: Arrival | None) -> None:
        """``req_id``, waiting since ``arrival``, was answered MISS (again: no change)."""
        if req_id in self._arrival_of:
            return
        self._arrival_of[req_id] = arrival
        if arrival is not None:
            bisect.insort(self._arrivals, arrival)

    def discard(self, req_id: str) -> None:
        """Forget ``req_id`` (unknown: no change)."""
        if req_id not in self._arrival_of:
            return
        arrival = self._arrival_of.pop(req_id)
        if arrival is not None:  # equal arrivals are interchangeable here: drop any one
            del self._arrivals[bisect.bisect_left(self._arrivals, arrival)]

    def ahead_of(self, req_id: str, arrival: Arrival | None) -> int:
        """How many waiting requests other than ``req_id`` arrived no later than ``arrival``
        (``None``: every waiting one)."""
        if arrival is None:
            ahead = len(self._arrivals)
        else:
            ahead = bisect.bisect_right(self._arrivals, arrival)
        own = self._arrival_of.get(req_id)
        if own is not None and (arrival is None or own <= arrival):
            ahead -= 1
        return ahead


__all__ = ["Arrival", "MissedQueue"]
