"""A tier-owned peer's remote slots (``PeerSlots``) and the slots late writes may still land on
(``Fences``): the per-peer state of ``index.BlockIndex``.

``PeerSlots`` is one registration of a peer whose slots the tier manages itself (a private
lease): a slot pool, the stored keys in LRU order (oldest first), each slot's digest
(``torch_kv_tier.digest``: what a load checks its bytes against), read pins (slot -> loads in
flight; a pinned slot is never evicted or reused), slots discarded while pinned (freed on the
last unpin) and slots withheld because a write of an earlier registration of the same peer id
may still land on them.

``Fences`` counts, per peer id, the writes of dropped registrations still in flight to each
slot; it outlives the registrations, so a peer that reconnects never reuses such a slot.

Threading: none; the owner (``BlockIndex``, under the manager's lock) serialises every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from torch_kv_tier.keys import Key
from torch_kv_tier.slots import SlotPool


class PeerSlots:
    """One peer registration's remote slots (module docstring)."""

    __slots__ = ("digests", "doomed", "lru", "peer_id", "pins", "pool", "withheld")

    def __init__(self, peer_id: str, slots: range) -> None:
        self.peer_id = peer_id
        self.pool = SlotPool(slots)
        self.lru: OrderedDict[Key, int] = OrderedDict()  # stored key -> slot, oldest first
        self.digests = [0] * len(slots)  # slot - slots.start -> digest of its stored key
        self.pins: dict[int, int] = {}  # slot -> loads in flight (only positive counts)
        self.doomed: set[int] = set()  # discarded while pinned: freed on the last unpin
        self.withheld: set[int] = set()  # fenced by an earlier registration's late write

    @property
    def used(self) -> int:
        return len(self.pool) - self.pool.num_free

    @property
    def capacity(self) -> int:
        return len(self.pool)

    @property
    def stored(self) -> int:
        return len(self.lru)

    def unpin(self, slots: list[int]) -> None:
        """Drop one pin of each slot; a discarded slot goes back to the pool on its last."""
        pins = self.pins
        counts = list(map(pins.pop, slots))
        for slot, count in zip(slots, counts):
            if count > 1:
                pins[slot] = count - 1
            elif slot in self.doomed:
                self.doomed.discard(slot)
                self.pool.free([slot])

    def withhold(self, slots: Iterable[int]) -> None:
        """Keep ``slots`` (of this registration's range) out of the pool: fenced."""
        fenced = [s for s in slots if s in self.pool.slots]
        self.pool.take(fenced)
        self.withheld.update(fenced)

    def give_back(self, slots: Iterable[int]) -> None:
        """The fences of ``slots`` are gone: those withheld go back to the pool."""
        back = [s for s in slots if s in self.withheld]
        self.withheld.difference_update(back)
        self.pool.free(back)


class Fences:
    """Per peer id, each slot's count of late writes still in flight (module docstring)."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[int, int]] = {}  # peer id -> slot -> late writes

    def add(self, peer_id: str, slots: Iterable[int]) -> None:
        """One more late write may land on each of ``slots``."""
        fences = self._pending.setdefault(peer_id, {})
        for slot in slots:
            fences[slot] = fences.get(slot, 0) + 1

    def resolve(self, peer_id: str, slots: Iterable[int]) -> list[int]:
        """One late write to each of ``slots`` resolved; the slots no write may land on now."""
        fences = self._pending.get(peer_id)
        if fences is None:
            return []
        released = []
        for slot in slots:
            count = fences.pop(slot, 0)
            if count > 1:
                fences[slot] = count - 1
            elif count == 1:
                released.append(slot)
        if not fences:
            del self._pending[peer_id]
        return released

    def of(self, peer_id: str) -> Collection[int]:
        """The slots of ``peer_id`` a late write may still land on."""
        return self._pending.get(peer_id, {}).keys()
