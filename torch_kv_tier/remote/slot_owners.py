"""``SlotOwners``: which key each slot of a pool (the DRAM one, or a disk's) holds, and a stamp of
when it was written there, for snapshots walked a part at a time (``shared_snapshot``).

Stamps count writes: each ``record`` is stamped one higher than the last, so a slot whose stamp
is at most the count read when a walk began holds what it held then (or nothing).

Threading: not thread-safe; its owner's thread (the server's loop, under its state lock) calls
every method.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

import numpy as np

from torch_kv_tier.keys import Key

Pair = tuple[str, Key]  # namespace, key
FORGET_AFTER = 1024  # namespace names recorded before those no slot holds are forgotten


class SlotOwners:
    """The key of each of ``num_slots`` slots (``None``: none), and its write stamp."""

    def __init__(self, num_slots: int) -> None:
        self.pairs: list[Pair | None] = [None] * num_slots
        self.stamps = np.zeros(num_slots, dtype=np.uint64)  # 0: never written
        self.count = 0  # writes recorded: the stamp of the last one
        # the namespace of each slot's key, by number (0: none), so that a walk picks a
        # namespace's slots in numpy (``held_by``); one number per namespace name some slot
        # held since the names none holds were last forgotten (``_forget_unheld``), with how
        # many slots hold it (``_held``), and the numbers of forgotten names, to reuse
        self.spaces = np.zeros(num_slots, dtype=np.uint32)
        self._ids: dict[str, int] = {}
        self._held = np.zeros(FORGET_AFTER + 1, dtype=np.int64)  # number -> slots holding it
        self._unused: list[int] = []  # numbers of forgotten names
        self._forget_at = FORGET_AFTER  # names known beyond which the unheld are forgotten

    def __len__(self) -> int:
        return len(self.pairs)

    def record(self, slots: Sequence[int], pairs: Sequence[Pair]) -> None:
        """``pairs`` were just written into ``slots``: one stamp for all of them."""
        if not slots:
            return
        self.count += 1
        for slot, pair in zip(slots, pairs):
            self.pairs[slot] = pair
        at = np.fromiter(slots, np.intp, len(slots))
        self.stamps[at] = self.count
        old = self.spaces[at]
        if old.any():  # overwritten keys (number 0: none; a commit's slots were cleared)
            np.subtract.at(self._held, old, 1)
        names = list(map(itemgetter(0), pairs))
        if names.count(names[0]) == len(names):  # one namespace's (a commit's always are)
            number = self._number(names[0])
            self.spaces[at] = number
            self._held[number] += len(names)
        else:
            numbers = {name: self._number(name) for name in dict.fromkeys(names)}
            new = np.fromiter(map(numbers.__getitem__, names), np.uint32, len(slots))
            self.spaces[at] = new
            np.add.at(self._held, new, 1)  # (number 0's count means nothing)
        if len(self._ids) > self._forget_at:
            self._forget_unheld()

    def _number(self, name: str) -> int:
        """The number of namespace ``name``: its own, else a forgotten name's, else a new one."""
        ids = self._ids
        number = ids.get(name)
        if number is None:
            number = ids[name] = self._unused.pop() if self._unused else len(ids) + 1
            if number >= len(self._held):
                self._held = np.concatenate((self._held, np.zeros_like(self._held)))
        return number

    def _forget_unheld(self) -> None:
        """Forget the namespace names no slot holds, their numbers reused by the next new
        names: a number kept for every name ever recorded grew without bound on a host whose
        tenants' namespaces came and went. A pass over the names known (each one's count of
        slots holding it is kept up to date), once per ``FORGET_AFTER`` names recorded at least:
        a pass over the slots instead (renumbering them) stalled the host's loop 30 to 160 ms
        at 4 M slots."""
        held = self._held
        gone = [name for name, number in self._ids.items() if not held[number]]
        for name in gone:
            self._unused.append(self._ids.pop(name))
        self._forget_at = max(FORGET_AFTER, 2 * len(self._ids))

    def clear(self, slots: Sequence[int]) -> None:
        """``slots`` hold no key any more."""
        if not slots:
            return
        pairs = self.pairs
        for slot in slots:
            pairs[slot] = None
        at = np.fromiter(slots, np.intp, len(slots))
        np.subtract.at(self._held, self.spaces[at], 1)
        self.spaces[at] = 0

    def held_by(self, start: int, stop: int, stamp: int, name: str) -> tuple[list[int], int]:
        """The slots of ``[start, stop)`` last written at or before write ``stamp`` that hold a
        key of namespace ``name`` now, and how many slots of ``[start, stop)`` were written by
        then (their key, of any namespace, may be gone since)."""
        part = self.stamps[start:stop]
        written = (part != 0) & (part <= stamp)
        ns_id = self._ids.get(name)
        if ns_id is None:
            return [], int(np.count_nonzero(written))
        held = np.flatnonzero(written & (self.spaces[start:stop] == ns_id)) + start
        return held.tolist(), int(np.count_nonzero(written))
