"""``DiskIndex``: which keys a host's disk holds, where, and the journal records of each change,
for ``disk_store.DiskStore`` (which does the I/O).

Global slot ``g`` is slot ``g // n`` of directory ``g % n`` (``n`` directories, each a
``disk_journal.DiskDir``). Every change of the index is appended to that directory's journal as
it is made: a ``PUT`` once a block is written, a ``DEL`` before its slot may be written again,
so a restart finds what the disk holds (``recover``). The index keeps its own LRU (``used``
marks a key read); a slot with I/O in flight (``slots``, a ``disk_slots.DiskSlots``) is never
evicted, nor free again before that I/O ends.

A directory whose last write failed (``failing``: read-only, full, EIO) loses no key it holds
for writes and takes no write but a probe, one slot at most every ``WRITE_PROBE_S``, its free
slots in turn (``take_slot``); the other directories take the copies, evicting their own keys.
Its free slots are held back meanwhile (``_parked``), and free again once a write to it is done
(``wrote``). One failing directory of several thus stops no copy to the others. A failure tied
to some slots (a sparse block file on a full file system) is not told apart: a probe that lands
on a good slot ends the failing, and the next write that takes a bad slot fails again, its
evicted keys lost; the probe period bounds how often.

Threading: not thread-safe; its store's thread calls every method.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from torch_kv_tier.remote.disk_frames import DEL, PUT, Record
from torch_kv_tier.remote.disk_io import Pair
from torch_kv_tier.remote.disk_journal import DiskDir
from torch_kv_tier.remote.disk_recovery import verified_index
from torch_kv_tier.remote.disk_slots import DiskSlots
from torch_kv_tier.remote.slot_owners import SlotOwners

WRITE_PROBE_S = 1.0  # a directory whose writes fail is written one slot at most this often
PARK_PER_TAKE = 64  # free slots of failing directories set aside per slot taken, at most


class DiskIndex:
    """The keys of the ``capacity`` global slots of ``dirs`` (module docstring)."""

    def __init__(self, dirs: Sequence[DiskDir], capacity: int) -> None:
        self._dirs = dirs
        self.slots = DiskSlots(capacity)  # global slots
        self.where: OrderedDict[Pair, tuple[int, int]] = OrderedDict()  # -> slot, digest; LRU
        self.owners = SlotOwners(capacity)  # global slot -> its key in ``where``
        self.failing: set[int] = set()  # directories whose last write failed
        self._parked: dict[int, deque[int]] = {}  # free slots of failing directories
        self._probe_at: dict[int, float] = {}  # a failing directory's next probe, monotonic

    def __len__(self) -> int:
        return len(self.where)

    def used(self, pair: Pair) -> tuple[int, int] | None:
        """``pair``'s slot and digest, now the most recently used; ``None``: not on disk."""
        entry = self.where.get(pair)
        if entry is not None:
            self.where.move_to_end(pair)
        return entry

    def at(self, pair: Pair, slot: int) -> bool:
        """Whether ``pair`` is on disk in ``slot`` (not removed, nor stored again, since)."""
        return self.where.get(pair, (None,))[0] == slot

    def put(self, pair: Pair, slot: int, digest: int) -> None:
        """``pair``'s block was written into ``slot`` (taken with ``take_slot``)."""
        self.where[pair] = (slot, digest)
        self._append(slot, PUT, pair, digest)

    def remove(self, pair: Pair) -> bool:
        """Forget ``pair`` (its slot is free once no I/O uses it); whether it was on disk."""
        entry = self.where.pop(pair, None)
        if entry is None:
            return False
        self._append(entry[0], DEL, pair, 0)
        self.slots.release(entry[0])
        return True

    def take_slot(self, evicted: list[Pair], now: float) -> int | None:
        """A slot for a write, now held: a failing directory's probe where one is due (module
        docstring), else a free slot of a directory not failing, else that of the least
        recently used key of such a directory with no I/O in flight, evicted (added to
        ``evicted``; the keys of failing directories before it are passed over); ``None``:
        none of these."""
        n = len(self._dirs)
        for _ in range(PARK_PER_TAKE):  # a bounded part of a dead directory's slots per take
            free = self.slots.take()
            if free is None or free % n not in self.failing:
                break
            self._parked.setdefault(free % n, deque()).append(free)
        else:  # the rest next time: no key is evicted while free slots may be left
            return None
        for f in self.failing:
            parked = self._parked.get(f)
            if parked and now > self._probe_at.get(f, -math.inf):  # one per ``now`` at most
                self._probe_at[f] = now + WRITE_PROBE_S
                if free is not None:
                    self.slots.release(free)  # taken next
                return parked.popleft()  # in turn: a bad slot is not probed on and on
        if free is not None or len(self.failing) == n:
            return free
        for pair, (slot, _) in self.where.items():
            if not self.slots.busy(slot) and slot % n not in self.failing:
                del self.where[pair]  # its record goes before the slot is rewritten
                self._append(slot, DEL, pair, 0)
                evicted.append(pair)
                return slot
        return None

    def wrote(self, f: int, ok: bool) -> None:
        """A write request to directory ``f`` ended (``ok``: done; failed, its slots released):
        ``f`` is failing, or no longer (its held-back free slots are free again)."""
        if not ok:
            self.failing.add(f)
        elif f in self.failing:
            self.failing.discard(f)  # its next probe no sooner (``_probe_at``): flapping bounded
            for free in self._parked.pop(f, ()):
                self.slots.release(free)

    def recover(self, block_len: int) -> int:
        """Rebuild the index from the journals, keeping the blocks that verify
        (``disk_recovery``), and rewrite each journal with its live records only (LRU order);
        returns how many keys were dropped. Call once, before any other I/O."""
        self.where, dropped = verified_index(self._dirs, block_len)
        held = [slot for slot, _ in self.where.values()]
        self.slots.reset(held)
        self.owners.record(held, list(self.where))
        n = len(self._dirs)
        for f, d in enumerate(self._dirs):  # at start, at once: in LRU order
            d.rewrite(
                (PUT, slot // n, ns, key, digest)
                for (ns, key), (slot, digest) in self.where.items()
                if slot % n == f
            )
        return dropped

    def live_records(self, f: int, start: int = 0, stop: int | None = None) -> list[Record]:
        """One ``PUT`` per key directory ``f`` holds in its slots ``[start, stop)`` (all by
        default), in slot order (a journal rewritten with them: ``disk_sync``)."""
        n, where, held = len(self._dirs), self.where, self.owners.pairs
        stop = self._dirs[f].slots if stop is None else stop
        return [
            (PUT, j, pair[0], pair[1], where[pair][1])
            for j in range(start, stop)
            if (pair := held[j * n + f]) is not None
        ]

    def _append(self, slot: int, op: int, pair: Pair, digest: int) -> None:
        """Journal a change of ``where`` at ``slot``, and keep ``owners`` in step with it."""
        n = len(self._dirs)
        if op == PUT:
            self.owners.record([slot], [pair])
        else:
            self.owners.clear([slot])
        self._dirs[slot % n].append(op, slot // n, pair[0], pair[1], digest)
