"""A shared pool's namespaces and their event log (``SharedCache`` owns both).

``Namespace`` holds one namespace's stored keys (least recently used first), the slots charged
to it as granted, and the keys stored and evicted since its last event batch. ``take_events``
turns those changes into numbered batches of final states, which the server pushes to every
session of the namespace (``shared_service``). ``DiskSide`` is what both ask of a disk tier
behind the pool.

Pure bookkeeping, not thread-safe: as ``SharedCache``, whose caller holds the server's state
lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch_kv_tier.keys import Key
from torch_kv_tier.remote.protocol import ON_DISK

if TYPE_CHECKING:
    from torch_kv_tier.remote.slot_owners import SlotOwners

EventBatch = tuple["Namespace", int, list[Key], list[int], list[int], list[Key]]


@dataclass
class Namespace:
    """One namespace's stored keys (``key -> slot``, least recently used first) and the events
    not yet taken."""

    name: str
    entries: OrderedDict[Key, int] = field(default_factory=OrderedDict)
    granted: int = 0  # slots granted to its sessions or promotions, not committed yet
    sessions: int = 0  # sessions joined
    event_seq: int = 0  # sequence number of the last event batch taken
    stored: list[Key] = field(default_factory=list)
    evicted: list[Key] = field(default_factory=list)  # left DRAM (the disk may keep them)

    @property
    def used(self) -> int:
        """Slots charged to the namespace: stored plus granted."""
        return len(self.entries) + self.granted


class DiskSide(Protocol):
    """What the cache asks of the disk behind it (``disk_store.DiskStore``)."""

    def contains(self, namespace: str, key: Key) -> bool: ...
    def digest(self, namespace: str, key: Key) -> int | None: ...
    def remove(self, namespace: str, key: Key) -> bool: ...
    def busy_dram_slots(self) -> set[int]: ...
    def slot_owners(self) -> SlotOwners: ...


def take_events(
    namespaces: Iterable[Namespace], digests: Sequence[int], disk: DiskSide | None, max_keys: int
) -> list[EventBatch]:
    """The changes of ``namespaces`` since the last call as ``(namespace, event_seq, stored,
    slots, digests, evicted)`` batches of at most ``max_keys`` keys; each namespace's sequence
    number grows by one per batch. A key is reported in its final state only (stored, with its
    slot and its digest in ``digests`` now, on disk: slot ``ON_DISK``, or evicted)."""
    batches: list[EventBatch] = []
    for ns in namespaces:
        if not ns.stored and not ns.evicted:  # most, on a host of many namespaces: no pass
            continue
        entries = ns.entries
        stored = [k for k in dict.fromkeys(ns.stored) if k in entries]
        evicted = [k for k in dict.fromkeys(ns.evicted) if k not in entries]
        on_disk: list[Key] = []
        if disk is not None and evicted:
            name = ns.name
            on_disk = [k for k in evicted if disk.contains(name, k)]
            kept = set(on_disk)
            evicted = [k for k in evicted if k not in kept]
        ns.stored, ns.evicted = [], []
        while stored or evicted or on_disk:
            ns.event_seq += 1
            out_evicted, evicted = evicted[:max_keys], evicted[max_keys:]
            room = max_keys - len(out_evicted)
            out_stored, stored = stored[:room], stored[room:]
            slots = list(map(entries.__getitem__, out_stored))
            out_digests = list(map(digests.__getitem__, slots))
            room -= len(out_stored)
            if room and on_disk:
                out_disk, on_disk = on_disk[:room], on_disk[room:]
                out_stored = out_stored + out_disk
                slots += [ON_DISK] * len(out_disk)
                out_digests += [0] * len(out_disk)
            batches.append((ns, ns.event_seq, out_stored, slots, out_digests, out_evicted))
    return batches
