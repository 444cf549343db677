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
slots in turn (``take_slot``); the other directories take the copies, in turn, evicting their
own keys (those of failing directories passed over go to the LRU's end: an eviction does not
walk them again). Each directory's free slots are kept apart (``DiskSlots``): a failing one's
cost a take no time, and are taken again once a write to it is done (``wrote``). One failing
directory of several thus stops no copy to the others; nor does one with a request ``stuck``
(a hung device: ``take_slot`` takes none of its slots, not even a probe). A failure tied to some
slots (a sparse block file on a full file system) is not told apart: a probe that lands on a good
slot ends the failing, and the next write that takes a bad slot fails again, its evicted keys
lost; the probe period bounds how often.

Threading: not thread-safe; its store's thread calls every method.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Sequence

from torch_kv_tier.remote.disk_frames import DEL, PUT, Record
from torch_kv_tier.remote.disk_io import Pair
from torch_kv_tier.remote.disk_journal import DiskDir
from torch_kv_tier.remote.disk_recovery import verified_index
from torch_kv_tier.remote.disk_slots import DiskSlots
from torch_kv_tier.remote.slot_owners import SlotOwners

WRITE_PROBE_S = 1.0  # a directory whose writes fail is written one slot at most this often


class DiskIndex:
    """The keys of the ``capacity`` global slots of ``dirs`` (module docstring)."""

    def __init__(self, dirs: Sequence[DiskDir], capacity: int) -> None:
        self._dirs = dirs
        self.slots = DiskSlots(capacity, len(dirs))  # global slots
        self.where: OrderedDict[Pair, tuple[int, int]] = OrderedDict()  # -> slot, digest; LRU
        self.owners = SlotOwners(capacity)  # global slot -> its key in ``where``
        self.failing: set[int] = set()  # directories whose last write failed
        self._turn = 0  # the directory a write takes a free slot of first
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

    def take_slot(self, evicted: list[Pair], now: float, stuck: Collection[int] = ()) -> int | None:
        """A slot for a write, now held: a failing directory's probe where one is due (module
        docstring), else a free slot of a directory not failing (each in turn), else that of
        the least recently used key of such a directory with no I/O in flight, evicted (added
        to ``evicted``); ``None``: none of these. The directories ``stuck`` (a request given up
        still in flight there) count as failing, and take no probe either."""
        slots, n = self.slots, len(self._dirs)
        out = self.failing.union(stuck)  # directories that take no write but a probe
        for f in self.failing.difference(stuck):
            if now > self._probe_at.get(f, -math.inf):  # one per ``now`` at most
                probe = slots.take(f, oldest=True)  # in turn: a bad slot is not probed on and on
                if probe is not None:
                    self._probe_at[f] = now + WRITE_PROBE_S
                    return probe
        for i in range(n):
            f = (self._turn + i) % n
            free = None if f in out else slots.take(f)
            if free is not None:
                self._turn = f + 1
                return free
        if len(out) == n:
            return None
        passed: list[Pair] = []  # keys of failing directories: to the LRU's end
        taken = None
        for pair, (slot, _) in self.where.items():
            if slot % n in out:
                passed.append(pair)
            elif not slots.busy(slot):
                taken = pair, slot
                break
        for pair in passed:
            self.where.move_to_end(pair)
        if taken is None:
            return None
        pair, slot = taken
        del self.where[pair]  # its record goes before the slot is rewritten
        self._append(slot, DEL, pair, 0)
        evicted.append(pair)
        return slot

    def wrote(self, f: int, ok: bool, now: float) -> None:
        """A write request to directory ``f`` ended at ``now`` (``ok``: done; failed, its slots
        released), or a request there was given up (not ``ok``): ``f`` is failing, its first
        probe ``WRITE_PROBE_S`` later, or no longer (its free slots are taken again; its next
        probe no sooner: flapping bounded)."""
        if ok:
            self.failing.discard(f)
        elif f not in self.failing:
            self.failing.add(f)
            self._probe_at[f] = max(now + WRITE_PROBE_S, self._probe_at.get(f, -math.inf))

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
