"""Snapshots of a shared pool's namespace for a tier that joins, walked a bounded part per page.

A snapshot walks the host's slots, not its keys: the disk's first (``DiskSide.slot_owners``),
then the pool's, a bounded part per page asked (``walk``), so a join costs the host's loop a few
ms per page at any number of keys (walking every key at once, millions on a large disk, stalled
the control plane of every other tier for seconds: 0.5 s at 1 M keys on disk, 1.8 s at 4 M). A
page is the namespace's keys found in the part walked, with their slots (``ON_DISK`` for a key
on disk only) and digests; every page carries the namespace's ``event_seq`` when the walk
began, ``E0``.

Keys change while the walk goes on, and the tier's copy still ends up exactly the host's index:

- every change of a key's state (stored, evicted, left the disk) is an event numbered after
  ``E0``, which the tier applies after the snapshot (``replica``): a key that changed may be
  found in any state, or not at all, its last event sets it;
- a key that did not change is found, once: in the slot it was written to before the walk began;
- no key is found twice (a tier's copy holds one slot per key): a slot is walked only if its key
  was written there before the walk began (``SlotOwners`` stamps), a key on disk only if it is not
  in DRAM, and the disk before the pool. A key found and then moved was written again after the
  walk began: to a DRAM slot, which the walk skips; to the disk, which it can leave only
  through DRAM (a promotion, skipped likewise), and back only by a copy written after it began.

Threading: as ``SharedCache``, which owns the slots walked.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch_kv_tier.keys import Key
from torch_kv_tier.remote.protocol import ON_DISK
from torch_kv_tier.remote.shared_events import Namespace

if TYPE_CHECKING:
    from torch_kv_tier.remote.shared_cache import SharedCache
    from torch_kv_tier.remote.shared_events import DiskSide
    from torch_kv_tier.remote.slot_owners import Pair, SlotOwners

SCAN_SLOTS = 8192  # keys one page holds at most (MAX_KEYS_PER_MESSAGE)
MAX_LOOKED = 4 * SCAN_SLOTS  # slots holding a key (of any namespace) one page looks at, at most
CHUNK = 1024  # slots walked per step of a page
MAX_WALK = 256 * CHUNK  # slots one page walks at most (empty ones cost a few ns each)

Page = tuple[list[Key], list[int], list[int]]  # keys, slots, digests


@dataclass
class Snapshot:
    """A walk in progress (module docstring): its namespace, ``E0``, the write stamps of the
    pool and the disk when it began, and the slots walked so far (the disk's, then the pool's)."""

    namespace: Namespace
    event_seq: int
    dram_stamp: int
    disk_stamp: int
    total: int  # slots to walk: the disk's and the pool's
    walked: int = 0

    @property
    def done(self) -> bool:
        return self.walked >= self.total


def begin(ns: Namespace, dram: SlotOwners, disk: DiskSide | None) -> Snapshot:
    """A walk of ``ns``'s keys in the pool's slots ``dram`` and ``disk``'s, from now on."""
    on_disk = disk.slot_owners() if disk is not None else None
    return Snapshot(
        ns,
        ns.event_seq,
        dram.count,
        on_disk.count if on_disk is not None else 0,
        len(dram) + (len(on_disk) if on_disk is not None else 0),
    )


def walk(snap: Snapshot, dram: SlotOwners, digests: list[int], disk: DiskSide | None) -> Page:
    """The next page of ``snap``: the keys found in its next slots, ``CHUNK`` at a time, until
    the next step could find more than ``SCAN_SLOTS`` in all, ``MAX_LOOKED`` slots holding a
    key were looked at, ``MAX_WALK`` slots walked, or the last one (a few ms at most)."""
    keys: list[Key] = []
    slots: list[int] = []
    found_digests: list[int] = []
    name, entries = snap.namespace.name, snap.namespace.entries
    on_disk = disk.slot_owners() if disk is not None else None
    n_disk = len(on_disk) if on_disk is not None else 0
    looked, limit = 0, min(snap.total, snap.walked + MAX_WALK)
    while snap.walked < limit and len(keys) + CHUNK <= SCAN_SLOTS and looked < MAX_LOOKED:
        start = snap.walked
        if start < n_disk:
            assert on_disk is not None
            stop = snap.walked = min(limit, start + CHUNK, n_disk)
            held, written = on_disk.held_by(start, stop, snap.disk_stamp, name)
            found = [k for k in _keys(on_disk.pairs, held) if k not in entries]
            keys += found
            slots += [ON_DISK] * len(found)
            found_digests += [0] * len(found)
        else:
            stop = snap.walked = min(limit, start + CHUNK)
            held, written = dram.held_by(start - n_disk, stop - n_disk, snap.dram_stamp, name)
            keys += _keys(dram.pairs, held)
            slots += held
            found_digests += map(digests.__getitem__, held)
        looked += written
    return keys, slots, found_digests


def whole(cache: SharedCache, session_id: str) -> tuple[list[Key], list[int], list[int], int]:
    """A whole snapshot at once: every stored key of the session's namespace, its slot and
    digest, and the event sequence number it is current for (for tests: a host walks one page
    per ask, ``walk``)."""
    snap = cache.begin_snapshot(session_id)
    pages: list[Page] = []
    while not snap.done:
        pages.append(cache.snapshot_part(snap))
    keys = [key for page in pages for key in page[0]]
    slots = [slot for page in pages for slot in page[1]]
    return keys, slots, [d for page in pages for d in page[2]], snap.event_seq


def _keys(pairs: list[Pair | None], slots: list[int]) -> map[Key]:
    """The keys of ``pairs`` in ``slots`` (each holding one), without a Python call per key."""
    return map(_second, map(pairs.__getitem__, slots))  # type: ignore[arg-type]


_second = operator.itemgetter(1)
