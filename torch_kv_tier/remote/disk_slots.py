"""``DiskSlots``: which of a disk tier's global slots are free, for ``disk_store.DiskStore``.

A slot is *never used* (from ``fresh`` on: handed out in order, so a new disk fills from its
start), *free again*, *held* (a block lives in it, or a write is filling it) or *released
while busy*: its block was dropped while I/O still uses it, and it is free only once that I/O
ends (``end_io``), so no new block is written where a read or a late write still lands.
Choosing which block to evict when none is free is the owner's (its LRU).

Threading: not thread-safe; its ``DiskStore``'s thread calls every method.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class DiskSlots:
    """The free, held and busy slots of ``capacity`` (module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._fresh = 0  # slots from here on were never used
        self._free: list[int] = []  # used slots free again
        self._released_busy: set[int] = set()  # free once their I/O ends
        self._busy: set[int] = set()  # I/O in flight

    def reset(self, held: Sequence[int]) -> None:
        """Start from the slots ``held`` (what recovery found, each below ``capacity``): every
        other slot below the highest one is free again, lowest first. In numpy: a per-slot
        Python set took most of a second per 4 M slots of a restart."""
        at = np.fromiter(held, np.intp, len(held))
        self._fresh = int(at.max()) + 1 if len(at) else 0
        free = np.ones(self._fresh, dtype=bool)
        free[at] = False
        self._free = np.flatnonzero(free)[::-1].tolist()

    def take(self) -> int | None:
        """A free slot, now held; None when every slot is held (the owner evicts)."""
        if self._free:
            return self._free.pop()
        if self._fresh < self.capacity:
            self._fresh += 1
            return self._fresh - 1
        return None

    def busy(self, slot: int) -> bool:
        return slot in self._busy

    def start_io(self, slot: int) -> None:
        self._busy.add(slot)

    def end_io(self, slot: int) -> None:
        """I/O on ``slot`` ended: free now if it was released meanwhile."""
        self._busy.discard(slot)
        if slot in self._released_busy:
            self._released_busy.discard(slot)
            self._free.append(slot)

    def release(self, slot: int) -> None:
        """A held slot's block is gone: free now, or once its I/O ends."""
        if slot in self._busy:
            self._released_busy.add(slot)
        else:
            self._free.append(slot)
