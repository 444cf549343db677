"""``SlotOwners``: which key each slot of a pool (the DRAM one, or a disk's) holds, and a stamp of
when it was written there, for snapshots walked a part at a time (``shared_snapshot``).

Stamps count writes: each ``record`` is stamped one higher than the last, so a slot whose stamp
is at most the count read when a walk began holds what it held then (or nothing).

Threading: not thread-safe; its owner's thread (the server's loop, under its state lock) calls
every method.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        # namespace's slots in numpy (``held_by``); one number per namespace name recorded
        # since the names no slot holds were last forgotten (``_forget_unheld``)
        self.spaces = np.zeros(num_slots, dtype=np.uint32)
        self._ids: dict[str, int] = {}
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
        ids = self._ids
        self.spaces[at] = np.fromiter(
            (ids.get(name) or ids.setdefault(name, len(ids) + 1) for name, _ in pairs),
            np.uint32,
            len(slots),
        )
        if len(ids) > self._forget_at:
            self._forget_unheld()

    def _forget_unheld(self) -> None:
        """Number the namespaces whose keys slots hold 1 to n, and forget the other names: a
        number kept for every name ever recorded grew without bound on a host whose tenants'
        namespaces came and went. One pass over the slots in numpy, once per ``FORGET_AFTER``
        names recorded at least."""
        held = np.bincount(self.spaces, minlength=len(self._ids) + 1) > 0
        held[0] = False
        renumber = np.zeros(len(held), dtype=np.uint32)
        renumber[held] = np.arange(1, np.count_nonzero(held) + 1, dtype=np.uint32)
        np.take(renumber, self.spaces, out=self.spaces)
        self._ids = {name: int(renumber[i]) for name, i in self._ids.items() if held[i]}
        self._forget_at = max(FORGET_AFTER, 2 * len(self._ids))

    def clear(self, slot: int) -> None:
        """``slot`` holds no key any more."""
        self.pairs[slot] = None
        self.spaces[slot] = 0

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
