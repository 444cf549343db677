"""``BlockIndex``: which key lives in which remote slot of which peer, and which slot to use next.

Pure bookkeeping: no I/O, no threads, no locks. The owner (``TierManager``) serialises every
call and decides *when* a key becomes visible (``publish`` after its write completed); this
module decides *where* (placement, slot pool, LRU eviction) and keeps the tables consistent.
Every operation takes a whole batch and does its per-key work in C-level container operations
(``dict.update``, ``map`` over bound methods) where the semantics allow.

State per peer registration (``PeerSlots``): a slot pool, the stored keys in LRU order (oldest
first), each slot's digest (``torch_kv_tier.digest``: what a load checks its bytes against),
read pins (slot -> loads in flight; a pinned slot is never evicted or reused), slots discarded
while pinned (freed on the last unpin) and slots withheld because a write of an earlier
registration of the same peer id may still land on them (``fence``).

A shared host (``SharedSlots``) keeps its own index: the host decides eviction, and this tier
holds a copy of the host's key set with each key's slot and each slot's digest (kept current
by the host's events, see ``apply_host_changes``); the slots the host granted it are its
``SharedHost``'s. A load reads a shared key's slot from the copy, unpinned: a slot evicted and
rewritten meanwhile fails its digest and is a miss.

Which peer holds a key: ``where`` maps the keys of tier-owned peers; a shared host's copy
answers for its own keys (no second map per key: a follower of a big host holds one dict
entry per key, not two). A key held by several peers is found on a tier-owned one first, then
on the shared hosts in the order they joined.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from itertools import islice, repeat
from typing import Literal

import numpy as np

from torch_kv_tier.keys import Key, Placement
from torch_kv_tier.slots import SlotPool

EventKind = Literal["stored", "evicted", "discarded", "lost"]
MAX_EVENTS = 100_000


def drain(iterator: Iterable[object]) -> None:
    """Run a ``map`` for its side effects at C speed."""
    deque(iterator, maxlen=0)


class PeerSlots:
    """One peer registration's remote slots (see the module docstring)."""

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


class SharedSlots:
    """A shared host's key set as this tier sees it: a copy of the host's keys with each one's
    slot, and each slot's digest, possibly stale (the slots the host granted this tier belong
    to its ``shared_host.SharedHost``).

    Digests are kept per slot, in one array the size of the host's pool: a slot holds one key
    at a time, and a per-key ``(slot, digest)`` tuple cost 56 B and a garbage-collector scan
    per key. A slot's digest is the one of the last key this copy learnt there; a key whose
    entry is stale fails it (digests are seeded with their key), which is a miss."""

    __slots__ = ("capacity", "digests", "entries", "peer_id")

    def __init__(self, peer_id: str, capacity: int) -> None:
        self.peer_id = peer_id
        self.capacity = capacity  # the host's pool, shared with every other tier
        self.entries: dict[Key, int] = {}  # the host's keys -> slot
        self.digests = np.zeros(capacity, dtype=np.uint64)  # slot -> digest

    def learn(self, keys: Sequence[Key], slots: Sequence[int], digests: Sequence[int]) -> None:
        """``keys`` are stored in ``slots`` with bytes of ``digests``."""
        self.entries.update(zip(keys, slots))
        if slots:
            n = len(slots)
            self.digests[np.fromiter(slots, np.int64, n)] = np.fromiter(digests, np.uint64, n)

    def find(self, keys: Sequence[Key]) -> tuple[list[int], list[int]]:
        """The slots and digests of stored ``keys``."""
        slots = list(map(self.entries.__getitem__, keys))
        return slots, self.digests[slots].tolist()

    @property
    def used(self) -> int:
        return len(self.entries)

    @property
    def stored(self) -> int:
        return len(self.entries)


AnyPeer = PeerSlots | SharedSlots


class BlockIndex:
    """Stored keys across peers: placement, LRU, pins, eviction and the event log."""

    def __init__(self, *, events: bool = False) -> None:
        self.peers: dict[str, AnyPeer] = {}
        # Stored key -> its peer (the slot is ``peer.lru[key]``). Values are references to
        # existing objects: publishing allocates no per-key container the garbage collector
        # would have to track and re-scan (a (peer, slot) tuple per key cost ~0.5 us per key
        # in collections once the index held tens of thousands of keys).
        self.where: dict[Key, PeerSlots] = {}  # keys of tier-owned peers only
        self.shared: list[SharedSlots] = []  # shared hosts, in the order they joined
        # The maps that say which keys are stored: ``where``, then each shared host's copy.
        self._maps: tuple[dict[Key, PeerSlots] | dict[Key, int], ...] = (self.where,)
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
        self._peers_changed()
        return peer

    def add_shared_peer(self, peer_id: str, capacity: int) -> SharedSlots:
        """A new shared host (its keys arrive with ``apply_host_changes``)."""
        if peer_id in self.peers:
            raise ValueError(f"peer {peer_id!r} is registered; remove it first")
        peer = self.peers[peer_id] = SharedSlots(peer_id, capacity)
        self.shared.append(peer)
        self._peers_changed()
        return peer

    def remove_peer(self, peer_id: str) -> list[Key]:
        """Forget a registration; returns its stored keys (now lost to this tier)."""
        peer = self.peers.pop(peer_id)
        if isinstance(peer, SharedSlots):
            self.shared.remove(peer)
            self._peers_changed()
            # another peer may hold some of the same keys
            lost = [key for key in peer.entries if self.holder(key) is None]
        else:
            self._peers_changed()
            lost = list(peer.lru)
            drain(map(self.where.pop, lost))
        self._log("lost", lost, peer_id)
        return lost

    # -- lookups and placement ----------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored."""
        where, shared = self.where, self.shared
        if not shared or (not where and len(shared) == 1):  # one map to ask
            held = shared[0].entries if shared else where
            for n, key in enumerate(keys):
                if key not in held:
                    return n
            return len(keys)
        maps = self._maps
        for n, key in enumerate(keys):
            if not any(key in held for held in maps):
                return n
        return len(keys)

    def holder(self, key: Key) -> AnyPeer | None:
        """The peer ``key`` is read from (module docstring); ``None``: not stored."""
        peer: AnyPeer | None = self.where.get(key)
        if peer is None:
            for shared in self.shared:
                if key in shared.entries:
                    return shared
        return peer

    def holders(self, keys: Sequence[Key]) -> list[AnyPeer | None]:
        """``holder`` of each key."""
        where, shared = self.where, self.shared
        if not where and shared:  # the first shared host answers for every key: C-level
            pick: dict[bool, AnyPeer | None] = {True: shared[0], False: None}
            held = list(map(pick.__getitem__, map(shared[0].entries.__contains__, keys)))
            shared = shared[1:]
        else:
            held = list(map(where.get, keys))
        for peer in shared:
            if None not in held:
                break
            has = peer.entries.__contains__
            held = [p if p is not None or not has(k) else peer for p, k in zip(held, keys)]
        return held

    def none_stored(self, keys: Collection[Key]) -> bool:
        """True when no key of ``keys`` is stored (one C-level pass per peer kind)."""
        return all(held.keys().isdisjoint(keys) for held in self._maps)

    @property
    def key_count(self) -> int:
        """Keys stored, a key held by several peers counted on each."""
        return len(self.where) + sum(len(peer.entries) for peer in self.shared)

    def _peers_changed(self) -> None:
        self._placement = Placement(self.peers)
        self._maps = (self.where, *(peer.entries for peer in self.shared))

    def place(
        self, keys: Sequence[Key], local: Sequence[int], digests: Sequence[int]
    ) -> dict[str, tuple[list, list, list]]:
        """Group ``keys`` (with their local blocks and digests) by home peer; ``{}`` without
        peers."""
        if not self.peers:
            return {}
        if len(self.peers) == 1:
            return {next(iter(self.peers)): (list(keys), list(local), list(digests))}
        groups: dict[str, tuple[list, list, list]] = {}
        for home, key, idx, digest in zip(self._placement.homes(keys), keys, local, digests):
            group = groups.get(home)
            if group is None:
                group = groups[home] = ([], [], [])
            group[0].append(key)
            group[1].append(idx)
            group[2].append(digest)
        return groups

    def touch(self, keys: Iterable[Key]) -> dict[SharedSlots, list[Key]]:
        """Mark stored ``keys`` most recently used (others are ignored); returns those on
        shared hosts, whose recency the caller reports to the host."""
        keys = list(keys)
        shared: dict[SharedSlots, list[Key]] = {}
        for key, peer in zip(keys, self.holders(keys)):
            if isinstance(peer, SharedSlots):
                shared.setdefault(peer, []).append(key)
            elif peer is not None:
                peer.lru.move_to_end(key)
        return shared

    # -- stores -------------------------------------------------------------------------------

    def reserve(self, peer: PeerSlots, n: int) -> list[int]:
        """Up to ``n`` slots of a tier-owned ``peer`` for new keys: free ones first, then the
        slots of its least recently used unpinned keys, which are evicted and handed over
        directly. (A shared host's slots come from its grants: ``SharedHost.take_slots``.)"""
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

    def publish(self, peer: AnyPeer, keys: list[Key], slots: list[int], digests: list[int]) -> None:
        """Make ``keys`` (written into ``slots``, bytes with ``digests``) visible, most
        recently used."""
        if isinstance(peer, SharedSlots):
            peer.learn(keys, slots, digests)
        else:
            lru, table, start = peer.lru, peer.digests, peer.pool.slots.start
            for key, slot, digest in zip(keys, slots, digests):  # beats OrderedDict.update
                lru[key] = slot
                table[slot - start] = digest
            self.where.update(dict.fromkeys(keys, peer))
        self._log("stored", keys, peer.peer_id)

    def apply_host_changes(
        self,
        peer: SharedSlots,
        stored: list[Key],
        slots: list[int],
        digests: list[int],
        evicted: list[Key],
        reset: bool,
    ) -> None:
        """A shared host's key set changed: ``stored`` keys now live in ``slots`` with
        ``digests`` (``reset``: they are all of it now)."""
        entries = peer.entries
        if reset:
            evicted = list(entries.keys() - set(stored)) if entries else []
        logged = self.events_enabled
        was = [key for key in dict.fromkeys(evicted) if key in entries] if logged else []
        drain(map(entries.pop, evicted, repeat(None)))
        new = [key for key in stored if self.holder(key) is None] if logged else []
        peer.learn(stored, slots, digests)
        self._log("evicted", [key for key in was if self.holder(key) is None], peer.peer_id)
        self._log("stored", new, peer.peer_id)

    # -- loads --------------------------------------------------------------------------------

    def locate(
        self, keys: Sequence[Key], local: Sequence[int]
    ) -> tuple[dict[AnyPeer, tuple[list, list, list, list]], list[Key]]:
        """Where stored ``keys`` are, to read them into ``local``: ``{peer: (keys, local,
        slots, digests)}`` and the missing keys. A tier-owned peer's slots are pinned (never
        evicted or reused until ``unpin``) and marked most recently used; a shared host's are
        read as the copy of its index has them (its recency is reported by the caller)."""
        entries = self.holders(keys)
        missing: list[Key] = []
        groups: dict[AnyPeer, tuple[list, list, list, list]] = {}
        if len(self.peers) == 1 and None not in entries:
            if entries:
                groups[entries[0]] = (list(keys), list(local), [], [])  # type: ignore[index]
        else:
            for key, idx, peer in zip(keys, local, entries):
                if peer is None:
                    missing.append(key)
                    continue
                group = groups.get(peer)
                if group is None:
                    group = groups[peer] = ([], [], [], [])
                group[0].append(key)
                group[1].append(idx)
        for peer, (gkeys, _, slots, digests) in groups.items():
            if isinstance(peer, SharedSlots):
                found_slots, found_digests = peer.find(gkeys)
                slots.extend(found_slots)
                digests.extend(found_digests)
                continue
            slots.extend(map(peer.lru.__getitem__, gkeys))
            table, start = peer.digests, peer.pool.slots.start
            digests.extend(table[slot - start] for slot in slots)
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

    def discard(self, keys: Iterable[Key], kind: EventKind = "discarded") -> None:
        """Forget stored ``keys`` (others are ignored); a pinned slot is freed on its last unpin.
        A shared host's key is forgotten by this tier only: other tiers may still use it.
        ``kind`` is the event logged ("lost" for keys whose bytes failed their digest)."""
        for key in keys:
            peer = self.holder(key)
            if peer is None:
                continue
            if isinstance(peer, SharedSlots):
                peer.entries.pop(key, None)
                self._log(kind, [key], peer.peer_id)
                continue
            del self.where[key]
            slot = peer.lru.pop(key)
            if slot in peer.pins:
                peer.doomed.add(slot)
            else:
                peer.pool.free([slot])
            self._log(kind, [key], peer.peer_id)

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
