"""``DiskSlots``: which of a disk tier's global slots are free, for ``disk_store.DiskStore``.

Global slot ``g`` is in directory ``g % dirs``; each directory's free slots are kept apart, so
a write takes a slot of the directory it chooses in constant time (``take``), whatever the
others hold (``disk_index.DiskIndex`` takes none of a failing directory's but a probe).

A slot is *never used* (from its directory's ``fresh`` on: handed out in order, so a new disk
fills from its start), *free again*, *held* (a block lives in it, or a write is filling it) or
*released while busy*: its block was dropped while I/O still uses it, and it is free only once
that I/O ends (``end_io``), so no new block is written where a read or a late write still lands.
Busy is counted per request: two reads of one block (or one refused while another is in flight)
keep its slot busy until both end.
Choosing which block to evict when none is free is the owner's (its LRU).

Threading: not thread-safe; its ``DiskStore``'s thread calls every method.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np


class DiskSlots:
    """The free, held and busy slots of ``capacity``, over ``dirs`` directories (module
    docstring)."""

    def __init__(self, capacity: int, dirs: int) -> None:
        self.capacity = capacity
        self._n = dirs
        self._fresh = list(range(dirs))  # per directory: its slots from here on were never used
        self._free: list[deque[int]] = [deque() for _ in range(dirs)]  # used ones free again
        self._released_busy: set[int] = set()  # free once their I/O ends
        self._busy: dict[int, int] = {}  # slot -> requests in flight using it

    def reset(self, held: Sequence[int]) -> None:
        """Start from the slots ``held`` (what recovery found, each below ``capacity``): every
        other slot below the highest one is free again, lowest first. In numpy: a per-slot
        Python set took most of a second per 4 M slots of a restart."""
        at = np.fromiter(held, np.intp, len(held))
        top = int(at.max()) + 1 if len(at) else 0
        free = np.ones(top, dtype=bool)
        free[at] = False
        n = self._n
        for f in range(n):
            self._free[f] = deque((np.flatnonzero(free[f::n]) * n + f)[::-1].tolist())
            self._fresh[f] = top + (f - top) % n  # its first slot from ``top`` on

    def take(self, f: int, *, oldest: bool = False) -> int | None:
        """A free slot of directory ``f``, now held: the one freed last (``oldest``: first,
        so that slots are taken in turn), else a never used one; None when ``f`` has none."""
        free = self._free[f]
        if free:
            return free.popleft() if oldest else free.pop()
        if self._fresh[f] < self.capacity:
            self._fresh[f] += self._n
            return self._fresh[f] - self._n
        return None

    def busy(self, slot: int) -> bool:
        return slot in self._busy

    def start_io(self, slot: int) -> None:
        """A request using ``slot`` starts (each is matched by one ``end_io``)."""
        self._busy[slot] = self._busy.get(slot, 0) + 1

    def end_io(self, slot: int) -> None:
        """A request using ``slot`` ended: the slot is free now if it was released meanwhile
        and no other request uses it."""
        count = self._busy.pop(slot) - 1
        if count:
            self._busy[slot] = count
        elif slot in self._released_busy:
            self._released_busy.discard(slot)
            self._free[slot % self._n].append(slot)

    def release(self, slot: int) -> None:
        """A held slot's block is gone: free now, or once its I/O ends."""
        if slot in self._busy:
            self._released_busy.add(slot)
        else:
            self._free[slot % self._n].append(slot)
