"""``SlotPool``: a free list of block slots that hands out contiguous runs when it can."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class SlotPool:
    """Tracks which of the slots ``range(start, start + count)`` are free.

    ``allocate(n)`` returns a contiguous run of ``n`` free slots when one exists (NIXL merges
    descriptors that are contiguous on both sides of a transfer), else the ``n`` lowest free
    slots. Runs are found next-fit: the slots right after the previous allocation are tried
    first, in O(n); only when they are taken does it search the whole pool for the lowest run.
    Not thread-safe: the owner serialises access.
    """

    def __init__(self, slots: range) -> None:
        if slots.step != 1 or len(slots) == 0:
            raise ValueError(f"slots must be a non-empty range with step 1, got {slots!r}")
        self.slots = slots
        self._free = np.ones(len(slots), dtype=bool)
        self._num_free = len(slots)
        self._cursor = 0  # offset just past the previous allocation

    @property
    def num_free(self) -> int:
        return self._num_free

    def __len__(self) -> int:
        return len(self.slots)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots; raise ``ValueError`` when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._num_free:
            raise ValueError(f"{n} slots requested but only {self._num_free} free")
        if n == 0:
            return []
        c = self._cursor
        if c + n <= len(self._free) and self._free[c : c + n].all():
            taken = np.arange(c, c + n)
        else:
            free = np.flatnonzero(self._free)
            spans = free[n - 1 :] - free[: len(free) - n + 1]
            runs = np.flatnonzero(spans == n - 1)
            taken = np.arange(free[runs[0]], free[runs[0]] + n) if runs.size else free[:n]
        self._free[taken] = False
        self._num_free -= n
        self._cursor = int(taken[-1]) + 1
        return (taken + self.slots.start).tolist()

    def free(self, idxs: Iterable[int]) -> None:
        """Return slots to the pool; raise ``ValueError`` on a foreign or already-free slot.

        Nothing is freed when any slot is invalid.
        """
        offsets = np.asarray(list(idxs), dtype=np.int64) - self.slots.start
        if offsets.size == 0:
            return
        foreign = (offsets < 0) | (offsets >= len(self.slots))
        if foreign.any():
            bad = int(offsets[foreign][0]) + self.slots.start
            raise ValueError(f"slot {bad} is not in this pool ({self.slots!r})")
        if len(np.unique(offsets)) != offsets.size or self._free[offsets].any():
            raise ValueError("double free: a slot is already free (or repeated in the call)")
        self._free[offsets] = True
        self._num_free += offsets.size

    def is_free(self, idx: int) -> bool:
        return bool(self._free[idx - self.slots.start])
