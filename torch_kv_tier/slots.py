"""``SlotPool``: a free list of block slots that hands out contiguous runs when it can."""

from __future__ import annotations

from collections.abc import Container, Iterable

_FREE, _TAKEN = 1, 0


class SlotPool:
    """Tracks which of the slots ``range(start, start + count)`` are free.

    ``allocate(n)`` returns a contiguous run of ``n`` free slots when one exists (NIXL merges
    descriptors that are contiguous on both sides of a transfer), else the ``n`` lowest free
    slots. Runs are found next-fit: the first run at or after the end of the previous
    allocation, else the lowest run. The free map is a ``bytearray`` (one byte per slot), so
    finding a run is one C-level ``find`` and taking it one slice assignment.
    Not thread-safe: the owner serialises access. A ``KeyboardInterrupt`` inside a call may
    lose the slots it was taking or freeing (the free count stays below the free map), never
    counts a taken slot free: the count drops before slots are marked taken and rises after
    they are marked free, so that no later ``allocate`` walks past the last free slot. The
    owner gets such slots back with ``reclaim``.
    """

    def __init__(self, slots: range) -> None:
        if slots.step != 1 or len(slots) == 0:
            raise ValueError(f"slots must be a non-empty range with step 1, got {slots!r}")
        self.slots = slots
        self._free = bytearray([_FREE]) * len(slots)
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
        free = self._free
        run = bytes([_FREE]) * n
        at = free.find(run, self._cursor)
        if at < 0:
            at = free.find(run)
        self._num_free -= n  # first: a Ctrl-C as slots are marked leaves it low (class docstring)
        if at >= 0:
            free[at : at + n] = bytes(n)
            self._cursor = at + n
            start = self.slots.start + at
            return list(range(start, start + n))
        taken: list[int] = []
        at = -1
        for _ in range(n):
            at = free.find(_FREE, at + 1)
            taken.append(at)
            free[at] = _TAKEN
        self._cursor = at + 1
        return [self.slots.start + t for t in taken]

    def take(self, idxs: Iterable[int]) -> None:
        """Mark specific free slots taken (e.g. withheld while a late write may land on them).

        Raises ``ValueError`` (and takes nothing) when a slot is foreign or not free.
        """
        offsets = self._offsets(idxs)
        if not all(self._free[o] for o in offsets):
            raise ValueError("slot already taken")
        self._num_free -= len(offsets)  # first, as ``allocate``'s
        for o in offsets:
            self._free[o] = _TAKEN

    def free(self, idxs: Iterable[int]) -> None:
        """Return slots to the pool; raise ``ValueError`` on a foreign or already-free slot.

        Nothing is freed when any slot is invalid.
        """
        offsets = self._offsets(idxs)
        free = self._free
        if any(map(free.__getitem__, offsets)):
            raise ValueError("double free: a slot is already free (or repeated in the call)")
        for o in offsets:
            free[o] = _FREE
        self._num_free += len(offsets)

    def _offsets(self, idxs: Iterable[int]) -> list[int]:
        start = self.slots.start
        offsets = [i - start for i in idxs]
        if not offsets:
            return offsets
        if min(offsets) < 0 or max(offsets) >= len(self._free):
            bad = next(o for o in offsets if not 0 <= o < len(self._free)) + start
            raise ValueError(f"slot {bad} is not in this pool ({self.slots!r})")
        if len(set(offsets)) != len(offsets):
            raise ValueError("double free: a slot is already free (or repeated in the call)")
        return offsets

    def reclaim(self, owned: Container[int]) -> list[int]:
        """Free every taken slot not in ``owned`` and count the free slots again: the owner's
        way back from slots an interrupted call lost (class docstring). Returns those freed.
        Marks them free before it counts, so that one interrupted may be called again."""
        start, free = self.slots.start, self._free
        lost = [o for o, f in enumerate(free) if not f and start + o not in owned]
        for o in lost:
            free[o] = _FREE
        self._num_free = free.count(_FREE)
        return [start + o for o in lost]

    def is_free(self, idx: int) -> bool:
        return bool(self._free[idx - self.slots.start])
