"""``Promotions``: loads waiting for a shared host to bring keys from its disk into DRAM.

A load of a key a host announced *on disk* (``serve --disk``) asks the host to promote it and
parks here, with its local blocks, until the host's index events announce the key in a DRAM
slot (then the tier reads it one-sidedly and verifies it, as any load), announce it gone (a
miss), or ``deadline`` passes (a miss: the host found no slot, or went silent). Nothing has been
read into a parked load's blocks, so failing it releases them at once.

State only: no lock, no thread. ``TierManager`` calls every method under its lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_kv_tier.keys import Key
from torch_kv_tier.records import Request


@dataclass
class Parked:
    """Keys of one load (and their local blocks) waiting for one host's promotion."""

    request: Request
    keys: list[Key]
    local: list[int]
    deadline: float  # time.monotonic() after which they are missing


class Promotions:
    """Parked loads, by the peer id of the host promoting their keys (module docstring)."""

    def __init__(self) -> None:
        self._parked: dict[str, list[Parked]] = {}
        # No parked deadline is earlier: ``take_expired`` walks the loads only once it passed
        # (the poller asks on every turn while transfers are in flight).
        self._earliest = math.inf

    def __bool__(self) -> bool:
        return bool(self._parked)

    def park(self, peer_id: str, parked: Parked) -> None:
        self._parked.setdefault(peer_id, []).append(parked)
        self._earliest = min(self._earliest, parked.deadline)

    def waiting_on(self, peer_id: str) -> bool:
        return peer_id in self._parked

    def take(self, peer_id: str) -> list[Parked]:
        """Every load parked on ``peer_id`` (its keys' state changed, or the peer is gone)."""
        return self._parked.pop(peer_id, [])

    def take_expired(self, now: float) -> list[Parked]:
        """The parked loads whose deadline passed."""
        if now < self._earliest:
            return []
        expired: list[Parked] = []
        earliest = math.inf
        for peer_id in list(self._parked):
            waiting = self._parked[peer_id]
            expired += [w for w in waiting if w.deadline <= now]
            left = [w for w in waiting if w.deadline > now]
            if left:
                self._parked[peer_id] = left
                earliest = min(earliest, min(w.deadline for w in left))
            else:
                del self._parked[peer_id]
        self._earliest = earliest
        return expired

    def take_all(self) -> list[Parked]:
        parked = [w for waiting in self._parked.values() for w in waiting]
        self._parked.clear()
        self._earliest = math.inf
        return parked
