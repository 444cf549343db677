"""``DiskIndex``: which keys a host's disk holds, where, and the journal records of each change,
for ``disk_store.DiskStore`` (which does the I/O).

Global slot ``g`` is slot ``g // n`` of directory ``g % n`` (``n`` directories, each a
``disk_journal.DiskDir``). Every change of the index is appended to that directory's journal as
it is made: a ``PUT`` once a block is written, a ``DEL`` before its slot may be written again,
so a restart finds what the disk holds (``recover``). The index keeps its own LRU (``used``
marks a key read); a slot with I/O in flight (``slots``, a ``disk_slots.DiskSlots``) is never
evicted, nor free again before that I/O ends.

Threading: not thread-safe; its store's thread calls every method.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch_kv_tier.remote.disk_frames import DEL, PUT, Record
from torch_kv_tier.remote.disk_io import Pair
from torch_kv_tier.remote.disk_journal import DiskDir
from torch_kv_tier.remote.disk_recovery import verified_index
from torch_kv_tier.remote.disk_slots import DiskSlots
from torch_kv_tier.remote.slot_owners import SlotOwners


class DiskIndex:
    """The keys of the ``capacity`` global slots of ``dirs`` (module docstring)."""

    def __init__(self, dirs: Sequence[DiskDir], capacity: int) -> None:
        self._dirs = dirs
        self.slots = DiskSlots(capacity)  # global slots
        self.where: OrderedDict[Pair, tuple[int, int]] = OrderedDict()  # -> slot, digest; LRU
        self.owners = SlotOwners(capacity)  # global slot -> its key in ``where``

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

    def take_slot(self, evicted: list[Pair], *, evict: bool = True) -> int | None:
        """A free slot, now held, else (with ``evict``) that of the least recently used key
        with no I/O in flight, evicted (added to ``evicted``); ``None``: none free and (with
        ``evict``) every slot has I/O in flight."""
        free = self.slots.take()
        if free is not None or not evict:
            return free
        for pair, (slot, _) in self.where.items():
            if not self.slots.busy(slot):  # its record goes before the slot is rewritten
                del self.where[pair]
                self._append(slot, DEL, pair, 0)
                evicted.append(pair)
                return slot
        return None

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
