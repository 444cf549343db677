"""``BlockIndex``: which key lives in which remote slot of which peer, and which slot to use next.

Pure bookkeeping: no I/O, no threads, no locks. The owner (``TierManager``) serialises every
call and decides *when* a key becomes visible (``publish`` after its write completed); this
module decides *where* (placement, slot pool, LRU eviction) and keeps the tables consistent.
Every operation takes a whole batch and does its per-key work in C-level container operations
(``dict.update``, ``map`` over bound methods) where the semantics allow.

State per peer registration (``PeerSlots``): a slot pool, the stored keys in LRU order (oldest
first), read pins (slot -> loads in flight; a pinned slot is never evicted or reused), slots
discarded while pinned (freed on the last unpin) and slots withheld because a write of an
earlier registration of the same peer id may still land on them (``fence``).

A shared host (``SharedSlots``) keeps its own index: the host decides eviction and pins, and
this tier holds a copy of the host's key set (kept current by the host's events, see
``apply_host_changes``) plus a batch of slots the host granted it for new keys.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat
from typing import Literal

from torch_kv_tier.keys import Key, Placement
from torch_kv_tier.slots import SlotPool

EventKind = Literal["stored", "evicted", "discarded", "lost"]
MAX_EVENTS = 100_000


def drain(iterator: Iterable[object]) -> None:
    """Run a ``map`` for its side effects at C speed."""
    deque(iterator, maxlen=0)


class PeerSlots:
    """One peer registration's remote slots (see the module docstring)."""

    __slots__ = ("doomed", "lru", "peer_id", "pins", "pool", "withheld")

    def __init__(self, peer_id: str, slots: range) -> None:
        self.peer_id = peer_id
        self.pool = SlotPool(slots)
        self.lru: OrderedDict[Key, int] = OrderedDict()  # stored key -> slot, oldest first
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


class SharedSlots:
    """A shared host as this tier sees it: the host's keys (a copy, possibly stale) and the
    slots the host granted this tier for new keys (used in order)."""

    __slots__ = ("capacity", "commits", "grants", "keys", "peer_id", "refilling")

    def __init__(self, peer_id: str, capacity: int) -> None:
        self.peer_id = peer_id
        self.capacity = capacity  # the host's pool, shared with every other tier
        self.keys: set[Key] = set()
        self.grants: deque[int] = deque()
        self.refilling = False  # a grant request is in flight
        self.commits = 0  # commit messages sent (each returns granted slots to the host)

    @property
    def used(self) -> int:
        return len(self.keys)

    @property
    def stored(self) -> int:
        return len(self.keys)


AnyPeer = PeerSlots | SharedSlots


class BlockIndex:
    """Stored keys across peers: placement, LRU, pins, eviction and the event log."""

    def __init__(self, *, events: bool = False) -> None:
        self.peers: dict[str, AnyPeer] = {}
        # Stored key -> its peer (the slot is ``peer.lru[key]``). Values are references to
        # existing objects: publishing allocates no per-key container the garbage collector
        # would have to track and re-scan (a (peer, slot) tuple per key cost ~0.5 us per key
        # in collections once the index held tens of thousands of keys).
        self.where: dict[Key, AnyPeer] = {}
        self.evictions = 0
        self.events_dropped = 0
        self._events: deque[tuple[str, Key, str]] | None = (
            deque(maxlen=MAX_EVENTS) if events else None
        )
        self._fences: dict[str, dict[int, int]] = {}  # peer id -> slot -> late writes pending
        self._placement = Placement(())

    # -- peers --------------------------------------------------------------------------------

    def add_peer(self, peer_id: str, slots: range) -> PeerSlots:
        """A new registration of ``peer_id`` (the caller removed any earlier one first)."""
        if peer_id in self.peers:
            raise ValueError(f"peer {peer_id!r} is registered; remove it first")
        peer = PeerSlots(peer_id, slots)
        fenced = [s for s in self._fences.get(peer_id, ()) if s in slots]
        peer.pool.take(fenced)
        peer.withheld.update(fenced)
        self.peers[peer_id] = peer
        self._placement = Placement(self.peers)
        return peer

    def add_shared_peer(self, peer_id: str, capacity: int) -> SharedSlots:
        """A new shared host (its keys arrive with ``apply_host_changes``)."""
        if peer_id in self.peers:
            raise ValueError(f"peer {peer_id!r} is registered; remove it first")
        peer = self.peers[peer_id] = SharedSlots(peer_id, capacity)
        self._placement = Placement(self.peers)
        return peer

    def remove_peer(self, peer_id: str) -> list[Key]:
        """Forget a registration; returns its stored keys (now lost to this tier)."""
        peer = self.peers.pop(peer_id)
        self._placement = Placement(self.peers)
        where = self.where
        if isinstance(peer, SharedSlots):  # another host may hold some of the same keys
            lost = [key for key in peer.keys if where.get(key) is peer]
        else:
            lost = list(peer.lru)
        drain(map(where.pop, lost))
        self._log("lost", lost, peer_id)
        return lost

    # -- lookups and placement ----------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored."""
        where = self.where
        for n, key in enumerate(keys):
            if key not in where:
                return n
        return len(keys)

    def place(self, keys: Sequence[Key], local: Sequence[int]) -> dict[str, tuple[list, list]]:
        """Group ``keys`` (with their local blocks) by home peer; ``{}`` without peers."""
        if not self.peers:
            return {}
        if len(self.peers) == 1:
            return {next(iter(self.peers)): (list(keys), list(local))}
        groups: dict[str, tuple[list, list]] = {}
        for home, key, idx in zip(self._placement.homes(keys), keys, local):
            group = groups.get(home)
            if group is None:
                group = groups[home] = ([], [])
            group[0].append(key)
            group[1].append(idx)
        return groups

    def touch(self, keys: Iterable[Key]) -> dict[SharedSlots, list[Key]]:
        """Mark stored ``keys`` most recently used; returns those on shared hosts, whose
        recency the caller reports to the host."""
        where = self.where
        shared: dict[SharedSlots, list[Key]] = {}
        for key in keys:
            peer = where[key]
            if isinstance(peer, SharedSlots):
                shared.setdefault(peer, []).append(key)
            else:
                peer.lru.move_to_end(key)
        return shared

    # -- stores -------------------------------------------------------------------------------

    def reserve(self, peer: AnyPeer, n: int) -> list[int]:
        """Up to ``n`` slots of ``peer`` for new keys: free ones first, then the slots of its
        least recently used unpinned keys, which are evicted and handed over directly. A shared
        host's slots come from its grants only (the host evicts when it grants)."""
        if isinstance(peer, SharedSlots):
            grants = peer.grants
            return [grants.popleft() for _ in range(min(n, len(grants)))]
        pool = peer.pool
        slots = pool.allocate(min(n, pool.num_free))
        need = n - len(slots)
        if need and peer.lru:
            lru, pins = peer.lru, peer.pins
            if not pins:
                victims = list(islice(lru, need))
            else:
                victims = [k for k, s in lru.items() if s not in pins][:need]
            slots += map(lru.pop, victims)
            drain(map(self.where.pop, victims))
            self.evictions += len(victims)
            self._log("evicted", victims, peer.peer_id)
        return slots

    def publish(self, peer: AnyPeer, keys: list[Key], slots: list[int]) -> None:
        """Make ``keys`` (written into ``slots``) visible, most recently used."""
        if isinstance(peer, SharedSlots):
            peer.keys.update(keys)
        else:
            lru = peer.lru
            for key, slot in zip(keys, slots):  # faster than OrderedDict.update's generic path
                lru[key] = slot
        self.where.update(dict.fromkeys(keys, peer))
        self._log("stored", keys, peer.peer_id)

    @staticmethod
    def release(peer: AnyPeer, slots: list[int]) -> None:
        """Return reserved slots that were not published (failed or discarded writes)."""
        if isinstance(peer, SharedSlots):
            peer.grants.extendleft(slots)
        else:
            peer.pool.free(slots)

    def apply_host_changes(
        self, peer: SharedSlots, stored: list[Key], evicted: list[Key], reset: bool
    ) -> None:
        """A shared host's key set changed (``reset``: ``stored`` is all of it now)."""
        where = self.where
        if reset:
            evicted = list(peer.keys.difference(stored))
        gone = [key for key in dict.fromkeys(evicted) if where.get(key) is peer]
        drain(map(where.pop, gone))
        peer.keys.difference_update(evicted)
        peer.keys.update(stored)
        new = [key for key in stored if key not in where]
        where.update(dict.fromkeys(new, peer))
        self._log("evicted", gone, peer.peer_id)
        self._log("stored", new, peer.peer_id)

    # -- loads --------------------------------------------------------------------------------

    def pin(
        self, keys: Sequence[Key], local: Sequence[int]
    ) -> tuple[dict[AnyPeer, tuple[list, list, list]], list[Key]]:
        """Pin the slots of stored ``keys`` and mark them most recently used.

        Returns ``{peer: (keys, local, slots)}`` for the stored ones and the missing keys. The
        slots of a shared host's keys are not known here (``[]``): the host pins them.
        """
        entries = list(map(self.where.get, keys))
        missing: list[Key] = []
        groups: dict[AnyPeer, tuple[list, list, list]] = {}
        if len(self.peers) == 1 and None not in entries:
            home = entries[0] if entries else None
            if home is not None:
                slots = (
                    [] if isinstance(home, SharedSlots) else list(map(home.lru.__getitem__, keys))
                )
                groups[home] = (list(keys), list(local), slots)
        else:
            for key, idx, peer in zip(keys, local, entries):
                if peer is None:
                    missing.append(key)
                    continue
                group = groups.get(peer)
                if group is None:
                    group = groups[peer] = ([], [], [])
                group[0].append(key)
                group[1].append(idx)
                if not isinstance(peer, SharedSlots):
                    group[2].append(peer.lru[key])
        for peer, (gkeys, _, slots) in groups.items():
            if isinstance(peer, SharedSlots):
                continue
            drain(map(peer.lru.move_to_end, gkeys))
            pins = peer.pins
            if pins.keys().isdisjoint(slots):
                pins.update(dict.fromkeys(slots, 1))
            else:
                for slot in slots:
                    pins[slot] = pins.get(slot, 0) + 1
        return groups, missing

    @staticmethod
    def unpin(peer: PeerSlots, slots: list[int]) -> None:
        """Drop one pin of each slot; a discarded slot goes back to the pool on its last."""
        pins = peer.pins
        counts = list(map(pins.pop, slots))
        for slot, count in zip(slots, counts):
            if count > 1:
                pins[slot] = count - 1
            elif slot in peer.doomed:
                peer.doomed.discard(slot)
                peer.pool.free([slot])

    # -- removal ------------------------------------------------------------------------------

    def discard(self, keys: Iterable[Key]) -> None:
        """Forget stored ``keys`` (others are ignored); a pinned slot is freed on its last unpin.
        A shared host's key is forgotten by this tier only: other tiers may still use it."""
        for key in keys:
            peer = self.where.pop(key, None)
            if peer is None:
                continue
            if isinstance(peer, SharedSlots):
                peer.keys.discard(key)
                self._log("discarded", [key], peer.peer_id)
                continue
            slot = peer.lru.pop(key)
            if slot in peer.pins:
                peer.doomed.add(slot)
            else:
                peer.pool.free([slot])
            self._log("discarded", [key], peer.peer_id)

    # -- late writes of dropped registrations -------------------------------------------------

    def fence(self, peer_id: str, slots: Iterable[int]) -> None:
        """A write to ``slots`` of a dropped registration of ``peer_id`` may still land: keep
        them out of every later registration's pool until ``unfence``."""
        fences = self._fences.setdefault(peer_id, {})
        for slot in slots:
            fences[slot] = fences.get(slot, 0) + 1

    def unfence(self, peer_id: str, slots: Iterable[int]) -> None:
        """That write resolved: the slots may be used again (by the current registration)."""
        fences = self._fences.get(peer_id)
        if fences is None:
            return
        released = []
        for slot in slots:
            count = fences.pop(slot, 0)
            if count > 1:
                fences[slot] = count - 1
            elif count == 1:
                released.append(slot)
        if not fences:
            del self._fences[peer_id]
        peer = self.peers.get(peer_id)
        if isinstance(peer, PeerSlots):
            back = [s for s in released if s in peer.withheld]
            peer.withheld.difference_update(back)
            peer.pool.free(back)

    def fenced(self, peer_id: str) -> int:
        """Slots of ``peer_id`` that a late write may still land on."""
        return len(self._fences.get(peer_id, ()))

    def drop_fences(self, peer_id: str) -> None:
        """The lease the fenced slots belonged to is gone: forget them (nothing is withheld)."""
        fences = self._fences.get(peer_id)
        if fences:
            self.unfence(peer_id, [s for s, n in fences.items() for _ in range(n)])

    # -- events -------------------------------------------------------------------------------

    @property
    def events_enabled(self) -> bool:
        return self._events is not None

    def take_events(self) -> list[tuple[str, Key, str]]:
        """Logged changes, oldest first; the log is emptied."""
        if self._events is None:
            return []
        events = list(self._events)
        self._events.clear()
        return events

    def _log(self, kind: EventKind, keys: list[Key], peer_id: str) -> None:
        log = self._events
        if log is None or not keys:
            return
        overflow = len(log) + len(keys) - MAX_EVENTS
        if overflow > 0:
            self.events_dropped += overflow
        # Plain tuples of atoms: the garbage collector stops tracking them.
        log.extend(zip(repeat(kind), keys, repeat(peer_id)))
