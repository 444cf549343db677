"""``BlockIndex``: which key lives in which remote slot of which peer, and which slot to use next.

Pure bookkeeping: no I/O, no threads, no locks. The owner (``TierManager``) serialises every
call and decides *when* a key becomes visible (``publish`` after its write completed); this
module decides *where* (placement, slot pool, LRU eviction) and keeps the tables consistent.
Every operation takes a whole batch and does its per-key work in C-level container operations
(``dict.update``, ``map`` over bound methods) where the semantics allow.

A tier-owned peer (a private lease) is a ``peer_slots.PeerSlots``: its slot pool, its keys in
LRU order, its slots' digests, read pins, and the slots withheld because a write of an earlier
registration of the same peer id may still land on them (``fence``, ``peer_slots.Fences``).

A shared host (``slot_maps.SharedSlots``) keeps its own index: the host decides eviction, and
this tier holds a copy of the host's key set with each key's slot and each slot's digest (kept
current by the host's events, see ``apply_host_changes``); the slots the host granted it are its
``SharedHost``'s. A load reads a shared key's slot from the copy, unpinned: a slot evicted and
rewritten meanwhile fails its digest and is a miss. The copy is a dict (fastest per call, ~150 B
per key) until the pools of the hosts this tier follows add up to more than
``COMPACT_AFTER_SLOTS``; each host joined after that, or every host with ``compact=True``, is
held in 16 B per key (``slot_maps.CompactSlots``), so a tier's index stays within ~150 MB plus
16 B per key whatever the fleet. Joining a host, applying its events and its keys on disk are
the base class's, ``shared_index.SharedIndex``.

Which peer holds a key: ``where`` maps the keys of tier-owned peers; a shared host's copy
answers for its own keys (no second map per key). A key held by several peers is found on a
tier-owned one first, then on the shared hosts in the order they joined.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat

from torch_kv_tier.keys import Key, Placement
from torch_kv_tier.peer_slots import Fences, PeerSlots
from torch_kv_tier.shared_index import COMPACT_AFTER_SLOTS, AnyPeer, EventKind, SharedIndex
from torch_kv_tier.slot_maps import SharedSlots, drain

MAX_EVENTS = 100_000


class BlockIndex(SharedIndex):
    """Stored keys across peers: placement, LRU, pins, eviction and the event log."""

    def __init__(self, *, events: bool = False, compact: bool | None = None) -> None:
        self.peers: dict[str, AnyPeer] = {}
        # A shared host's copy in a dict or a compact table (``slot_maps``); ``None``: compact
        # once the pools of the hosts followed would add up to more than COMPACT_AFTER_SLOTS.
        self.compact = compact
        # Stored key -> its peer (the slot is ``peer.lru[key]``). Values are references to
        # existing objects: publishing allocates no per-key container the garbage collector
        # would have to track and re-scan (a (peer, slot) tuple per key cost ~0.5 us per key
        # in collections once the index held tens of thousands of keys).
        self.where: dict[Key, PeerSlots] = {}  # keys of tier-owned peers only
        self.shared: list[SharedSlots] = []  # shared hosts, in the order they joined
        self.evictions = 0
        self.events_dropped = 0
        self._events: deque[tuple[str, Key, str]] | None = (
            deque(maxlen=MAX_EVENTS) if events else None
        )
        self._fences = Fences()
        self._placement = Placement(())

    # -- peers --------------------------------------------------------------------------------

    def add_peer(self, peer_id: str, slots: range) -> PeerSlots:
        """A new registration of ``peer_id`` (the caller removed any earlier one first)."""
        if peer_id in self.peers:
            raise ValueError(f"peer {peer_id!r} is registered; remove it first")
        peer = PeerSlots(peer_id, slots)
        peer.withhold(self._fences.of(peer_id))
        self.peers[peer_id] = peer
        self._peers_changed()
        return peer

    def remove_peer(self, peer_id: str) -> list[Key]:
        """Forget a registration; returns its stored keys (now lost to this tier)."""
        peer = self.peers.pop(peer_id)
        if isinstance(peer, SharedSlots):
            self.shared.remove(peer)
            self._peers_changed()
            # another peer may hold some of the same keys (named only when events are logged)
            lost = self._unheld(list(peer.map.keys()))
        else:
            self._peers_changed()
            lost = list(peer.lru)
            drain(map(self.where.pop, lost))
        self._log("lost", lost, peer_id)
        return lost

    # -- lookups and placement ----------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored (in a peer's memory or on a host's disk)."""
        n = self._lookup_held(keys)
        if n < len(keys) and self.has_disk_keys():
            holder, disk_holder = self.holder, self.disk_holder
            while n < len(keys) and (
                holder(keys[n]) is not None or disk_holder(keys[n]) is not None
            ):
                n += 1
        return n

    def _lookup_held(self, keys: Sequence[Key]) -> int:
        if not self.shared:
            where = self.where
            for n, key in enumerate(keys):
                if key not in where:
                    return n
            return len(keys)
        if len(keys) > 16:  # a pass per peer beats numpy's per-call cost past a few keys
            if not self.where and len(self.shared) == 1:
                has = self.shared[0].map.contains(keys)
                return has.index(False) if False in has else len(keys)
            held = self.holders(keys)
            return held.index(None) if None in held else len(keys)
        holder = self.holder
        for n, key in enumerate(keys):
            if holder(key) is None:
                return n
        return len(keys)

    def holder(self, key: Key) -> AnyPeer | None:
        """The peer ``key`` is read from (module docstring); ``None``: not stored."""
        peer: AnyPeer | None = self.where.get(key)
        if peer is None:
            for shared in self.shared:
                if shared.map.contains_one(key):
                    return shared
        return peer

    def holders(self, keys: Sequence[Key]) -> list[AnyPeer | None]:
        """``holder`` of each key (one pass per peer kind: a dict's and each table's)."""
        where, shared = self.where, self.shared
        if not where and shared:  # the first shared host answers for every key
            pick: tuple[AnyPeer | None, AnyPeer] = (None, shared[0])
            held = list(map(pick.__getitem__, shared[0].map.contains(keys)))
            shared = shared[1:]
        else:
            held = list(map(where.get, keys))
        for peer in shared:
            if None not in held:
                break
            has = peer.map.contains(keys)
            held = [p if p is not None or not h else peer for p, h in zip(held, has)]
        return held

    def none_stored(self, keys: Sequence[Key]) -> bool:
        """True when no key of ``keys`` is stored (one pass per peer kind)."""
        if not self.where.keys().isdisjoint(keys):
            return False
        return not any(peer.map.holds_any(keys) for peer in self.shared)

    def _unheld(self, keys: Sequence[Key]) -> list[Key]:
        """Those of ``keys`` no peer holds."""
        return [k for k, held in zip(keys, self.holders(keys)) if held is None]

    @property
    def key_count(self) -> int:
        """Keys stored, a key held by several peers counted on each."""
        return len(self.where) + sum(peer.stored for peer in self.shared)

    def _peers_changed(self) -> None:
        self._placement = Placement(self.peers)

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
                victims = list(islice((k for k, s in lru.items() if s not in pins), need))
            slots += map(lru.pop, victims)
            drain(map(self.where.pop, victims))
            self.evictions += len(victims)
            self._log("evicted", victims, peer.peer_id)
        return slots

    def publish(self, peer: AnyPeer, keys: list[Key], slots: list[int], digests: list[int]) -> None:
        """Make ``keys`` (written into ``slots``, bytes with ``digests``) visible, most
        recently used."""
        if isinstance(peer, SharedSlots):
            peer.publish(keys, slots, digests)
        else:
            lru, table, start = peer.lru, peer.digests, peer.pool.slots.start
            for key, slot, digest in zip(keys, slots, digests):  # beats OrderedDict.update
                lru[key] = slot
                table[slot - start] = digest
            self.where.update(dict.fromkeys(keys, peer))
        self._log("stored", keys, peer.peer_id)

    # -- loads --------------------------------------------------------------------------------

    def locate(
        self, keys: Sequence[Key], local: Sequence[int]
    ) -> tuple[dict[AnyPeer, tuple[list, list, list, list]], list[Key]]:
        """Where stored ``keys`` are, to read them into ``local``: ``{peer: (keys, local,
        slots, digests)}`` and the missing keys. A tier-owned peer's slots are pinned (never
        evicted or reused until ``unpin``) and marked most recently used; a shared host's are
        read as the copy of its index has them (its recency is reported by the caller)."""
        if len(self.peers) == 1 and self.shared:  # one host: one pass finds every slot
            return self._locate_on(self.shared[0], keys, local)
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

    # -- removal ------------------------------------------------------------------------------

    def discard(self, keys: Iterable[Key], kind: EventKind = "discarded") -> None:
        """Forget stored ``keys`` (others are ignored); a pinned slot is freed on its last unpin.
        A shared host's key is forgotten by this tier only (other tiers may still use it), each
        host's in one pass. ``kind`` is the event logged ("lost" for keys whose bytes failed
        their digest)."""
        keys = list(dict.fromkeys(keys))
        shared: dict[SharedSlots, list[Key]] = {}
        for key, peer in zip(keys, self.holders(keys)):
            if peer is None:
                continue
            if isinstance(peer, SharedSlots):
                shared.setdefault(peer, []).append(key)
                continue
            del self.where[key]
            slot = peer.lru.pop(key)
            if slot in peer.pins:
                peer.doomed.add(slot)
            else:
                peer.pool.free([slot])
            self._log(kind, [key], peer.peer_id)
        for host, gone in shared.items():
            host.map.forget(gone)
            self._log(kind, gone, host.peer_id)

    def discard_read(self, peer_id: str, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """Forget ``keys`` whose bytes, read from ``slots`` of ``peer_id``, failed their digest
        (``discard(kind="lost")``), except those this copy maps elsewhere by now: stored again
        while the read was in flight, that entry is another copy of the key."""
        peer = self.peers.get(peer_id)
        if peer is None:
            return
        held = self.holders(keys)
        now = peer.map.slots(keys) if isinstance(peer, SharedSlots) else map(peer.lru.get, keys)
        self.discard(
            [k for k, s, n, h in zip(keys, slots, now, held) if h is peer and n == s], "lost"
        )

    # -- late writes of dropped registrations -------------------------------------------------

    def fence(self, peer_id: str, slots: Iterable[int]) -> None:
        """A write to ``slots`` of a dropped registration of ``peer_id`` may still land: keep
        them out of every later registration's pool until ``unfence``."""
        self._fences.add(peer_id, slots)

    def unfence(self, peer_id: str, slots: Iterable[int]) -> None:
        """That write resolved: the slots may be used again (by the current registration)."""
        released = self._fences.resolve(peer_id, slots)
        peer = self.peers.get(peer_id)
        if isinstance(peer, PeerSlots):
            peer.give_back(released)

    def fenced(self, peer_id: str) -> int:
        """Slots of ``peer_id`` that a late write may still land on."""
        return len(self._fences.of(peer_id))

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


__all__ = ["COMPACT_AFTER_SLOTS", "AnyPeer", "BlockIndex", "drain"]
