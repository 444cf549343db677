"""A shared host's key -> slot map, as a tier's copy of the host's index holds it
(``SharedSlots``: the map and each slot's digest).

Two implementations of one interface, chosen per host by ``index.BlockIndex``:

- ``DictSlots``: a ``dict``. The fastest per call (a 16-key store check costs ~2 µs here),
  about 150 B per key (the key's bytes object, its entry, its slot int).
- ``CompactSlots``: ``key_table.KeyTable``, 8 B per key and no Python object per key, at
  numpy's per-call cost (~10 µs for the same check on this 2-core VM), plus a small dict for
  this tier's own commits until the host's events echo them (so a store costs a dict update,
  not a merge into the table).

A lookup of either may answer a slot whose key changed meanwhile (a stale copy) and
``CompactSlots`` may answer the slot of a key with the same fingerprint: both cost a miss,
never wrong bytes, because a load checks the bytes it read against the slot's digest seeded with
the key it asked for (``digest``). ``CompactSlots`` keys its table by fingerprints of another
family (``TABLE_FAMILY``) than the digests' seeds: with the same family, two keys whose seeds
agree would be one entry there, and a load of either would read the other's bytes and pass its
check (odds of a stored key's seed for any key looked up: keys stored / 2**64, rather than
about 2**-128 with two independent families).

Threading: none; the owner (``BlockIndex``, under the tier's lock) serialises every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np

from torch_kv_tier.key_table import KeyTable
from torch_kv_tier.keys import Key, key_fingerprint, key_fingerprints
from torch_kv_tier.remote.protocol import ON_DISK

TABLE_FAMILY = 4  # ``CompactSlots``' fingerprints: independent of the digests' seeds (family 0)


def _fingerprints(keys: Sequence[Key]) -> np.ndarray:
    """The keys' fingerprints in ``CompactSlots``' table (``TABLE_FAMILY``)."""
    return key_fingerprints(keys, TABLE_FAMILY)


def drain(iterator: Iterable[object]) -> None:
    """Run a ``map`` for its side effects at C speed."""
    deque(iterator, maxlen=0)


class DictSlots:
    """Key -> slot in a ``dict`` (module docstring)."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> Iterable[Key]:
        """The stored keys (this map keeps them anyway)."""
        return self._slots.keys()

    def publish(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """This tier committed ``keys`` to ``slots``."""
        self._slots.update(zip(keys, slots))

    learn = publish  # the host stores ``keys`` in ``slots``

    def forget(self, keys: Sequence[Key]) -> None:
        drain(map(self._slots.pop, keys, repeat(None)))

    def reset(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        self._slots = dict(zip(keys, slots))

    def slots(self, keys: Sequence[Key]) -> list[int]:
        """The slot of each of ``keys``, ``-1`` for one not stored."""
        return list(map(self._slots.get, keys, repeat(-1)))

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return list(map(self._slots.__contains__, keys))

    def contains_one(self, key: Key) -> bool:
        return key in self._slots

    def holds_any(self, keys: Sequence[Key]) -> bool:
        return not self._slots.keys().isdisjoint(keys)


class CompactSlots:
    """Key -> slot in a ``KeyTable`` of fingerprints (module docstring). The keys themselves are
    kept only with ``keep_keys`` (an index that logs events must name a lost host's keys)."""

    __slots__ = ("_kept", "_pending", "_table")

    MAX_PENDING = 4096  # own commits not yet echoed by the host, at most

    def __init__(self, capacity: int, *, keep_keys: bool = False) -> None:
        self._table = KeyTable(capacity)
        self._pending: dict[Key, int] = {}
        self._kept: set[Key] | None = set() if keep_keys else None

    def __len__(self) -> int:
        return len(self._table) + len(self._pending)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def keys(self) -> Iterable[Key]:
        """The stored keys if they are kept, else none."""
        return self._kept if self._kept is not None else ()

    def publish(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """This tier committed ``keys`` to ``slots``: a dict update until the host echoes them
        (or ``MAX_PENDING`` wait: the host's events are late, and no dict grows unbounded)."""
        self._pending.update(zip(keys, slots))
        if self._kept is not None:
            self._kept.update(keys)
        if len(self._pending) > self.MAX_PENDING:
            pending, self._pending = self._pending, {}
            fingerprints = _fingerprints(list(pending))
            self._table.insert(fingerprints, np.fromiter(pending.values(), np.int64))

    def learn(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """The host stores ``keys`` in ``slots``."""
        if keys:
            self._settle(keys)
            self._table.insert(_fingerprints(keys), np.fromiter(slots, np.int64, len(slots)))
            if self._kept is not None:
                self._kept.update(keys)

    def forget(self, keys: Sequence[Key]) -> None:
        if keys:
            self._settle(keys)
            self._table.remove(_fingerprints(keys))
            if self._kept is not None:
                self._kept.difference_update(keys)

    def reset(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """``keys`` are all the host stores: this tier's commits not echoed yet go too (the
        host read those sent before the snapshot first; ``SharedSlots.reset`` publishes again
        those it cannot have)."""
        self._pending = {}
        self._table.reset(_fingerprints(keys), np.fromiter(slots, np.int64, len(slots)))
        if self._kept is not None:
            self._kept = set(keys)

    def _settle(self, keys: Sequence[Key]) -> None:
        """The host's word on ``keys`` replaces this tier's own."""
        if self._pending:
            drain(map(self._pending.pop, keys, repeat(None)))

    def slots(self, keys: Sequence[Key]) -> list[int]:
        """The slot of each of ``keys``, ``-1`` for one not stored."""
        pending = self._pending
        if not keys or not len(self._table):
            return [pending.get(k, -1) for k in keys]
        slots = self._table.slots(_fingerprints(keys)).tolist()
        if pending and not pending.keys().isdisjoint(keys):
            slots = [pending.get(k, s) for k, s in zip(keys, slots)]
        return slots

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        pending = self._pending
        if not keys or not len(self._table):
            return [k in pending for k in keys]
        held = self._table.contains(_fingerprints(keys)).tolist()
        if pending and not pending.keys().isdisjoint(keys):
            held = [h or k in pending for k, h in zip(keys, held)]
        return held

    def contains_one(self, key: Key) -> bool:
        return key in self._pending or self._table.contains_one(key_fingerprint(key, TABLE_FAMILY))

    def holds_any(self, keys: Sequence[Key]) -> bool:
        return any(self.contains(keys))


SlotMap = DictSlots | CompactSlots


def _split_on_disk(
    keys: Sequence[Key], slots: Sequence[int], digests: Sequence[int]
) -> tuple[list[Key], list[int], list[int], list[Key]]:
    """``(keys, slots, digests)`` of the keys in DRAM, and the keys on disk."""
    ram = [i for i, s in enumerate(slots) if s != ON_DISK]
    on_disk = [k for k, s in zip(keys, slots) if s == ON_DISK]
    return [keys[i] for i in ram], [slots[i] for i in ram], [digests[i] for i in ram], on_disk


class SharedSlots:
    """A shared host's key set as this tier sees it: each key's slot (``slot_maps``: a dict, or
    for a tier that follows many keys a table of 8 B per key) and each slot's digest, possibly
    stale (the slots the host granted this tier belong to its ``shared_host.SharedHost``).

    Digests are kept per slot, in one array the size of the host's pool: a slot holds one key
    at a time. A slot's digest is the one of the last key this copy learnt there; a key whose
    entry is stale, or whose fingerprint another key shares, fails it (digests are seeded with
    their key): a miss. So a compact follower holds 16 B per key of a full host.

    Keys the host holds only on its disk (announced in slot ``ON_DISK``) are in ``disk``, a map
    of the same kind (every slot 0): they are stored, but a load asks the host to promote them
    first.

    A snapshot replaces the copy but for this tier's commits that reached the host after it was
    taken (``reset``'s ``sent``: ``remote.replica``), whose echo comes later: hiding them
    meanwhile, a load would miss a key its store just reported stored."""

    __slots__ = ("capacity", "digests", "disk", "map", "peer_id")

    def __init__(self, peer_id: str, capacity: int, slot_map: SlotMap, disk: SlotMap) -> None:
        self.peer_id = peer_id
        self.capacity = capacity  # the host's pool, shared with every other tier
        self.map = slot_map  # the host's keys -> slot
        self.disk = disk  # the host's keys on its disk only
        self.digests = np.zeros(capacity, dtype=np.uint64)  # slot -> digest

    def publish(self, keys: Sequence[Key], slots: Sequence[int], digests: Sequence[int]) -> None:
        """This tier committed ``keys`` to ``slots`` with bytes of ``digests``."""
        self.map.publish(keys, slots)
        self.digests[list(slots)] = digests
        if len(self.disk):
            self.disk.forget(keys)

    def learn(self, keys: Sequence[Key], slots: Sequence[int], digests: Sequence[int]) -> None:
        """The host stores ``keys`` in ``slots`` with bytes of ``digests`` (or on its disk)."""
        if ON_DISK in slots:
            keys, slots, digests, on_disk = _split_on_disk(keys, slots, digests)
            self.map.forget(on_disk)
            self.disk.learn(on_disk, [0] * len(on_disk))
        self.map.learn(keys, slots)
        self._set_digests(slots, digests)
        if len(self.disk):
            self.disk.forget(keys)

    def reset(
        self,
        keys: Sequence[Key],
        slots: Sequence[int],
        digests: Sequence[int],
        sent: Iterable[tuple[Sequence[Key], Sequence[int], Sequence[int]]],
    ) -> None:
        """``keys`` are all the host stores now, but for the batches of commits this tier
        ``sent`` after the snapshot was taken (or not yet): those the snapshot lacks are
        published again (a key it has keeps the host's slot: the first commit of a key wins)."""
        on_disk: list[Key] = []
        if ON_DISK in slots:
            keys, slots, digests, on_disk = _split_on_disk(keys, slots, digests)
        self.map.reset(keys, slots)
        self.disk.reset(on_disk, [0] * len(on_disk))
        self._set_digests(slots, digests)
        for own_keys, own_slots, own_digests in sent:
            kept = [i for i, held in enumerate(self.map.contains(own_keys)) if not held]
            if kept:
                self.publish(
                    [own_keys[i] for i in kept],
                    [own_slots[i] for i in kept],
                    [own_digests[i] for i in kept],
                )

    def forget(self, keys: Sequence[Key]) -> None:
        """The host no longer holds ``keys``, in DRAM or on disk."""
        self.map.forget(keys)
        if len(self.disk):
            self.disk.forget(keys)

    def _set_digests(self, slots: Sequence[int], digests: Sequence[int]) -> None:
        if slots:
            n = len(slots)
            self.digests[np.fromiter(slots, np.int64, n)] = np.fromiter(digests, np.uint64, n)

    def find(self, keys: Sequence[Key]) -> tuple[list[int], list[int]]:
        """The slots (``-1``: not stored) and digests of ``keys``."""
        slots = self.map.slots(keys)
        return slots, self.digests[slots].tolist()

    @property
    def used(self) -> int:
        return len(self.map)

    @property
    def stored(self) -> int:
        return len(self.map)
