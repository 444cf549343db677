"""``SharedCache``: the host-side index of a shared pool (which key lives in which slot).

Pure bookkeeping (no I/O, no clock of its own: callers pass ``now``), so it is tested directly.
Not thread-safe: the server guards it with its state lock, like the ``LeaseTable`` whose
``SlotPool`` it draws its slots from (slots a private lease holds are never touched here).

Model. Keys are namespaced (the config fingerprint of the sessions that store them): two models
never see each other's blocks. A slot is in exactly one state:

- *free*: drawn from the pool, not yet handed out;
- *granted* to one session: only that session may write it, nothing is published there;
- *stored*: holds a committed key of one namespace; readable by every session of it;
- *quarantined*: granted to a session that ended without committing it. A client that froze
  may still write there, so the slot is reused only after ``quarantine_s``.

A store is ``grant`` (a private batch of slots, ahead of time), a one-sided write by the client,
then ``commit``: the key becomes visible, most recently used. A load is ``pin`` (the slots of
stored keys, kept from eviction until ``unpin`` or ``ttl_s``), a one-sided read, ``unpin``.
A reader that finishes within the TTL it was granted therefore read the committed bytes: a
stored slot is rewritten only after it was evicted, re-granted and written again.

Capacity is one LRU over every stored slot, refreshed by ``touch`` and ``pin``. When a grant
needs slots and none is free, the least recently used unpinned key is evicted; a namespace at
its quota evicts its own keys instead, so one tenant cannot take another's share. Every change
is logged per namespace (``take_events``) for the server to push to the sessions.

Slots come from the server's ``SlotPool`` only as grants need them; once drawn they stay with
the shared cache (reused for shared keys, never returned), so private leases get the slots the
shared pool has not filled yet.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch_kv_tier.remote.leases import SlotPool

Key = bytes | str | int


@dataclass
class Namespace:
    """One namespace's stored keys (``key -> slot``, least recently used first) and the events
    not yet taken."""

    name: str
    entries: OrderedDict[Key, int] = field(default_factory=OrderedDict)
    granted: int = 0  # slots granted to this namespace's sessions, not yet committed
    event_seq: int = 0  # sequence number of the last event batch taken
    stored: list[Key] = field(default_factory=list)
    evicted: list[Key] = field(default_factory=list)

    @property
    def used(self) -> int:
        """Slots charged to the namespace: stored plus granted."""
        return len(self.entries) + self.granted


@dataclass
class _Pin:
    session_id: str
    slots: list[int]
    expires: float


class SharedCache:
    """Slots of one host's pool shared by every session of a namespace (module docstring).

    ``quota`` caps the slots one namespace may use (stored plus granted; default: the whole
    pool); ``max_granted`` caps the slots one session may hold granted and uncommitted
    (default: a sixteenth of the pool, at most 4096), so that a session's reserve never evicts
    much of what others stored; ``pin_ttl_s`` bounds how long a pin holds; ``quarantine_s`` is
    how long a slot granted to an ended session waits before it is reused.
    """

    def __init__(
        self,
        pool: SlotPool,
        *,
        quota: int | None = None,
        max_granted: int | None = None,
        pin_ttl_s: float = 10.0,
        quarantine_s: float = 60.0,
    ) -> None:
        if quota is not None and quota <= 0:
            raise ValueError(f"namespace quota must be > 0 slots, got {quota}")
        if max_granted is not None and max_granted <= 0:
            raise ValueError(f"max granted slots must be > 0, got {max_granted}")
        if pin_ttl_s <= 0 or quarantine_s < 0:
            raise ValueError(
                f"pin TTL must be > 0 and quarantine >= 0 s, got {pin_ttl_s} and {quarantine_s}"
            )
        self.pool = pool
        self.quota = pool.num_blocks if quota is None else quota
        self.max_granted = (
            max(1, min(4096, pool.num_blocks // 16)) if max_granted is None else max_granted
        )
        self.pin_ttl_s = pin_ttl_s
        self.quarantine_s = quarantine_s
        self.namespaces: dict[str, Namespace] = {}
        self.evictions = 0
        self._free: list[int] = []
        self._lru: OrderedDict[tuple[str, Key], int] = OrderedDict()  # every stored key
        self._grants: dict[str, tuple[Namespace, set[int]]] = {}  # session -> its granted slots
        self._pins: dict[int, _Pin] = {}
        self._pinned: dict[int, int] = {}  # slot -> pins holding it
        self._quarantine: deque[tuple[float, list[int]]] = deque()
        self._pin_ids = itertools.count(1)

    # -- sessions -----------------------------------------------------------------------------

    def join(self, session_id: str, namespace: str) -> None:
        """A shared session of ``namespace`` starts."""
        ns = self.namespaces.get(namespace)
        if ns is None:
            ns = self.namespaces[namespace] = Namespace(namespace)
        self._grants[session_id] = (ns, set())

    def leave(self, session_id: str, now: float, *, clean: bool) -> None:
        """A session ended: its pins go, and its uncommitted grants are free again at once
        after a ``clean`` disconnect (the client wrote nothing more), else quarantined."""
        ns, granted = self._grants.pop(session_id, (None, set()))
        if ns is not None and granted:
            ns.granted -= len(granted)
            if clean:
                self._free.extend(granted)
            else:
                self._quarantine.append((now + self.quarantine_s, sorted(granted)))
        for pin_id in [i for i, pin in self._pins.items() if pin.session_id == session_id]:
            self._unpin_one(pin_id)

    # -- stores -------------------------------------------------------------------------------

    def grant(self, session_id: str, want: int, now: float) -> list[int]:
        """Up to ``want`` slots only ``session_id`` may write: free ones, else the slots of
        evicted keys (never pinned ones). Fewer, or none, when the session already holds
        ``max_granted``, the namespace is at its quota with nothing evictable, or every slot
        is pinned or granted."""
        ns, granted = self._grants[session_id]
        want = min(want, self.max_granted - len(granted))
        self._release_quarantine(now)
        self.expire_pins(now)
        slots: list[int] = []
        while len(slots) < want:
            if ns.used + len(slots) >= self.quota:
                slot = self._evict_from(ns)
            else:
                slot = self._take_free(want - len(slots))
                if slot is None:
                    slot = self._evict_oldest()
            if slot is None:
                break
            slots.append(slot)
        granted.update(slots)
        ns.granted += len(slots)
        return slots

    def commit(self, session_id: str, keys: Sequence[Key], slots: Sequence[int]) -> int:
        """Publish ``keys``, written into granted ``slots``; returns how many were published.

        A slot not granted to this session is ignored (it may have been quarantined when the
        session expired); a key already stored keeps its first copy and the slot is free again.
        """
        entry = self._grants.get(session_id)
        if entry is None:
            return 0
        ns, granted = entry
        published = 0
        for key, slot in zip(keys, slots):
            if slot not in granted:
                continue
            granted.discard(slot)
            ns.granted -= 1
            if key in ns.entries:
                self._free.append(slot)
                continue
            ns.entries[key] = slot
            self._lru[(ns.name, key)] = slot
            ns.stored.append(key)
            published += 1
        return published

    # -- loads --------------------------------------------------------------------------------

    def pin(self, session_id: str, keys: Iterable[Key], now: float) -> tuple[int, list[int]]:
        """Pin the slots of stored ``keys`` (most recently used now) until ``unpin`` or the
        TTL. Returns the pin id and each key's slot, ``-1`` for a key that is not stored."""
        ns, _ = self._grants[session_id]
        entries, lru, pinned = ns.entries, self._lru, self._pinned
        slots = []
        for key in keys:
            slot = entries.get(key, -1)
            if slot >= 0:
                entries.move_to_end(key)
                lru.move_to_end((ns.name, key))
                pinned[slot] = pinned.get(slot, 0) + 1
            slots.append(slot)
        pin_id = next(self._pin_ids)
        self._pins[pin_id] = _Pin(session_id, [s for s in slots if s >= 0], now + self.pin_ttl_s)
        return pin_id, slots

    def unpin(self, session_id: str, pin_ids: Iterable[int]) -> None:
        """Drop pins of ``session_id`` (unknown or expired ones are ignored)."""
        for pin_id in pin_ids:
            pin = self._pins.get(pin_id)
            if pin is not None and pin.session_id == session_id:
                self._unpin_one(pin_id)

    def expire_pins(self, now: float) -> int:
        """Drop every pin past its TTL; returns how many."""
        late = [i for i, pin in self._pins.items() if pin.expires <= now]
        for pin_id in late:
            self._unpin_one(pin_id)
        return len(late)

    def touch(self, session_id: str, keys: Iterable[Key]) -> None:
        """Mark stored ``keys`` most recently used (unknown keys are ignored)."""
        ns, _ = self._grants[session_id]
        entries, lru = ns.entries, self._lru
        for key in keys:
            if key in entries:
                entries.move_to_end(key)
                lru.move_to_end((ns.name, key))

    # -- observation --------------------------------------------------------------------------

    def snapshot(self, session_id: str) -> tuple[list[Key], int]:
        """Every stored key of the session's namespace and the event sequence number it is
        current for (events with a higher number come after it)."""
        ns, _ = self._grants[session_id]
        return list(ns.entries), ns.event_seq

    def namespace_of(self, session_id: str) -> str:
        return self._grants[session_id][0].name

    def take_events(self, max_keys: int) -> list[tuple[Namespace, int, list[Key], list[Key]]]:
        """Changes since the last call as ``(namespace, event_seq, stored, evicted)`` batches of
        at most ``max_keys`` keys; each namespace's sequence number grows by one per batch.
        A key both stored and evicted since the last call is reported in its final state only."""
        batches = []
        for ns in self.namespaces.values():
            stored, evicted = ns.stored, ns.evicted
            ns.stored, ns.evicted = [], []
            both = set(stored).intersection(evicted) if stored and evicted else ()
            if both:  # only such a key can be listed twice (stored, evicted, stored ...)
                entries = ns.entries
                stored = list(dict.fromkeys(k for k in stored if k not in both or k in entries))
                evicted = list(
                    dict.fromkeys(k for k in evicted if k not in both or k not in entries)
                )
            while stored or evicted:
                ns.event_seq += 1
                out_evicted, evicted = evicted[:max_keys], evicted[max_keys:]
                room = max_keys - len(out_evicted)
                out_stored, stored = stored[:room], stored[room:]
                batches.append((ns, ns.event_seq, out_stored, out_evicted))
        return batches

    @property
    def stored(self) -> int:
        return len(self._lru)

    @property
    def granted(self) -> int:
        return sum(len(granted) for _, granted in self._grants.values())

    @property
    def quarantined(self) -> int:
        return sum(len(slots) for _, slots in self._quarantine)

    @property
    def pinned(self) -> int:
        return len(self._pinned)

    # -- internals ----------------------------------------------------------------------------

    def _take_free(self, need: int) -> int | None:
        """A free slot: one freed here before, else drawn from the pool (only as many as the
        grant needs, so the rest stays available to private leases)."""
        if not self._free:
            run = self.pool.take(need) if self.pool.free else None
            if run is None:
                return None
            self._free.extend(reversed(run))  # pop() hands out the lowest slot first
        return self._free.pop()

    def _evict_oldest(self) -> int | None:
        for (name, key), slot in self._lru.items():
            if slot not in self._pinned:
                self._evict(self.namespaces[name], key)
                return slot
        return None

    def _evict_from(self, ns: Namespace) -> int | None:
        for key, slot in ns.entries.items():
            if slot not in self._pinned:
                self._evict(ns, key)
                return slot
        return None

    def _evict(self, ns: Namespace, key: Key) -> None:
        del ns.entries[key]
        del self._lru[(ns.name, key)]
        ns.evicted.append(key)
        self.evictions += 1

    def _unpin_one(self, pin_id: int) -> None:
        pinned = self._pinned
        for slot in self._pins.pop(pin_id).slots:
            count = pinned.pop(slot)
            if count > 1:
                pinned[slot] = count - 1

    def _release_quarantine(self, now: float) -> None:
        while self._quarantine and self._quarantine[0][0] <= now:
            self._free.extend(self._quarantine.popleft()[1])
