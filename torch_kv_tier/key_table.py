"""``KeyTable``: which slot of a shared host holds a key, in 8 bytes per key.

A tier follows the key set of every shared host it uses, so lookups answer with no round trip.
Held as Python objects that cost ~150 B per key (issue 20): a follower of a 1 TiB host of
64 KiB blocks would carry GBs. Here a key is one ``uint64`` entry and no Python object: the top
``64 - slot_bits`` bits of its fingerprint (``keys.key_fingerprints``, of the family
``slot_maps.TABLE_FAMILY``) over the slot number in
the low ``slot_bits`` bits, where ``slot_bits`` is what the host's pool needs with all ones to
spare (a tombstone): 25 bits for 2**24 slots, which leaves a 39-bit fingerprint.

Layout: two sorted ``uint64`` arrays searched with one binary search each. ``_recent`` takes
every insert (a merge of the batch, linear in its size); once it outgrows ``1/32`` of the table
(at least ``MIN_RECENT`` entries) it is merged into ``_main`` (linear in the table). A removal
turns an entry into a tombstone in place (its slot bits all ones), which keeps the order the
searches rely on (by fingerprint first; a group of equal fingerprints keeps its live entries
before its tombstones), and merges drop tombstones. Between two merges into ``_main`` the arrays
hold at most ``1/32`` more entries than live keys, tombstones included.

No keys are kept, so two keys whose fingerprints agree are one group: a lookup of either
answers the slot of the first, and removing either removes both. Neither costs wrong bytes: a
load checks the bytes it read against the slot's digest, seeded with the key it asked for
(``digest``) by a fingerprint of another family, so a read of the other key's slot is a miss.
At 16 M keys and 39-bit fingerprints that is about 250 colliding pairs, and a lookup of an
absent key answers "stored" with odds of 1 in 32,000.

Threading: none; the owner serialises every call (``index.BlockIndex``, under the tier's lock).
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

MIN_RECENT = 8192
_EMPTY = np.empty(0, np.uint64)


class KeyTable:
    """Fingerprint -> slot for up to ``capacity`` slots (module docstring)."""

    __slots__ = ("_groups", "_high", "_live", "_main", "_mask", "_mask_int", "_recent", "_views")

    def __init__(self, capacity: int) -> None:
        bits = max(1, int(capacity).bit_length())  # slots < 2**bits - 1: all ones is free
        self._mask_int = (1 << bits) - 1
        self._mask = np.uint64(self._mask_int)
        self._high = np.uint64(~self._mask_int & 0xFFFF_FFFF_FFFF_FFFF)
        self._groups = self._high.item()  # the same, as a Python int, for the one-key path
        self._main = self._recent = _EMPTY
        self._views = (_EMPTY.data, _EMPTY.data)  # recent, main: for bisect
        self._live = 0

    def __len__(self) -> int:
        """Live entries: stored keys (two keys of one fingerprint stored apart count twice)."""
        return self._live

    @property
    def nbytes(self) -> int:
        return self._main.nbytes + self._recent.nbytes

    # -- lookups ------------------------------------------------------------------------------

    def slots(self, fingerprints: np.ndarray) -> np.ndarray:
        """The slot of each fingerprint (``int64``), ``-1`` where none is stored."""
        return self._slots_of_groups(fingerprints & self._high)

    def contains(self, fingerprints: np.ndarray) -> np.ndarray:
        """Whether each fingerprint is stored (``bool`` array)."""
        return self._probe(fingerprints & self._high) < self._mask

    def _slots_of_groups(self, groups: np.ndarray) -> np.ndarray:
        """``slots`` of fingerprints with their slot bits cleared (sorted ones search faster)."""
        found = self._probe(groups)
        slots = found.view(np.int64)
        slots[found >= self._mask] = -1
        return slots

    def _probe(self, groups: np.ndarray) -> np.ndarray:
        """Per group: its live entry's slot, or a value of at least the tombstone's. An entry
        XOR its group is its slot when it is live and of that group, and at least the tombstone
        value otherwise; a group has one live entry at most across both arrays (``insert``
        removes it before it stores it again), so the smaller of the two answers is the one: a
        handful of numpy calls per array, whatever the batch."""
        found: np.ndarray | None = None
        for table in (self._main, self._recent):
            if not len(table):
                continue
            here = table.take(table.searchsorted(groups), mode="clip")
            here ^= groups
            found = here if found is None else np.minimum(found, here, out=found)
        return found if found is not None else np.full(len(groups), self._mask)

    def contains_one(self, fingerprint: int) -> bool:
        """``contains`` of one fingerprint, without numpy's per-call cost (vLLM asks one key at a
        time on its scheduler thread)."""
        group, mask = fingerprint & self._groups, self._mask_int
        for view in self._views:
            at = bisect_left(view, group)
            if at < len(view):
                entry = view[at]
                if entry & ~mask == group and entry & mask != mask:
                    return True
        return False

    # -- changes ------------------------------------------------------------------------------

    def insert(self, fingerprints: np.ndarray, slots: np.ndarray) -> None:
        """Store each fingerprint in its slot. One already stored in that slot is left as it is;
        one stored in another slot moves (its group is removed first)."""
        batch = _sorted_unique((fingerprints & self._high) | slots.astype(np.uint64, copy=False))
        found = self._slots_of_groups(batch & self._high)
        fresh = found != (batch & self._mask).astype(np.int64)
        if not fresh.all():
            batch, found = batch[fresh], found[fresh]
        if not len(batch):
            return
        moved = found >= 0
        if moved.any():
            self.remove(batch[moved])
        self._live += len(batch)
        recent = _merge(self._alive(self._recent), batch)
        if len(recent) > max(MIN_RECENT, len(self._main) >> 5):
            self._set(_merge(self._alive(self._main), recent), _EMPTY)
        else:
            self._set(self._main, recent)

    def remove(self, fingerprints: np.ndarray) -> int:
        """Remove every entry of each fingerprint's group; returns how many were live."""
        groups = _sorted_unique(fingerprints & self._high)
        removed = 0
        for table in (self._main, self._recent):
            at = np.searchsorted(table, groups)
            g = groups
            while len(at):
                inside = at < len(table)
                at, g = at[inside], g[inside]
                entry = table[at]
                live = ((entry & self._high) == g) & ((entry & self._mask) != self._mask)
                at, g = at[live], g[live]
                table[at] = g | self._mask  # tombstones: the order is kept
                removed += len(at)
                at = at + 1  # a group's live entries come first: look at the next one
        self._live -= removed
        return removed

    def reset(self, fingerprints: np.ndarray, slots: np.ndarray) -> None:
        """Hold exactly these entries."""
        batch = _sorted_unique((fingerprints & self._high) | slots.astype(np.uint64, copy=False))
        self._set(batch, _EMPTY)
        self._live = len(batch)

    def _alive(self, table: np.ndarray) -> np.ndarray:
        return table[(table & self._mask) != self._mask]

    def _set(self, main: np.ndarray, recent: np.ndarray) -> None:
        self._main, self._recent = main, recent
        self._views = (recent.data, main.data)


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``values`` sorted, repeats dropped (a sort and one pass: ``np.unique`` hashes first)."""
    out = np.sort(values)
    if len(out) > 1:
        repeat = out[1:] == out[:-1]
        if repeat.any():
            out = out[np.concatenate(([True], ~repeat))]
    return out


def _merge(table: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """Sorted ``table`` and sorted ``batch`` as one sorted array (linear in their sizes)."""
    if not len(table):
        return batch
    return np.insert(table, np.searchsorted(table, batch), batch)
