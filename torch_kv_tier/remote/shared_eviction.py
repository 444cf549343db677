"""Which stored keys a ``SharedCache`` evicts when a grant needs slots and none is free: the
least recently used of every namespace (``evict_oldest``), or of one namespace at its quota
(``evict_from``), never a key whose slot the disk behind the pool is copying from (the next
least recently used instead).

Each function removes its victims from the cache's structures that the caller passes (its LRU,
the namespaces' entries, the slots' owners), announces them evicted (``Namespace.evicted``, for
``take_events``) and returns their slots, now the caller's to hand out; counting the evictions
is the caller's. Pure bookkeeping, not thread-safe: called under the server's state lock, as
the ``SharedCache`` that owns these structures is. Nothing raises for fewer keys than asked:
fewer slots come back (none for ``n <= 0``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice
from typing import Any

from torch_kv_tier.keys import Key
from torch_kv_tier.remote.shared_events import DiskSide, Namespace
from torch_kv_tier.remote.slot_owners import SlotOwners


def evict_oldest(
    lru: OrderedDict[tuple[str, Key], int],
    namespaces: dict[str, Namespace],
    owners: SlotOwners,
    disk: DiskSide | None,
    n: int,
) -> list[int]:
    """The slots of up to ``n`` least recently used keys of any namespace, evicted."""
    busy = disk.busy_dram_slots() if disk is not None else None
    if busy:
        victims = _oldest_not_in(lru.items(), busy, n)
        for pair, _ in victims:
            del lru[pair]
        for (name, key), _ in victims:
            del namespaces[name].entries[key]
            namespaces[name].evicted.append(key)
        slots = [slot for _, slot in victims]
        owners.clear(slots)
        return slots
    slots = []
    for _ in range(min(n, len(lru))):
        (name, key), slot = lru.popitem(last=False)
        ns = namespaces[name]
        del ns.entries[key]
        ns.evicted.append(key)
        slots.append(slot)
    owners.clear(slots)
    return slots


def evict_from(
    ns: Namespace,
    lru: OrderedDict[tuple[str, Key], int],
    owners: SlotOwners,
    disk: DiskSide | None,
    n: int,
) -> list[int]:
    """The slots of up to ``n`` of ``ns``'s least recently used keys, evicted."""
    entries, name, evicted = ns.entries, ns.name, ns.evicted
    busy = disk.busy_dram_slots() if disk is not None else None
    if busy:
        victims = _oldest_not_in(entries.items(), busy, n)
    else:
        victims = list(islice(entries.items(), max(n, 0)))
    for key, _ in victims:
        del entries[key]
        del lru[(name, key)]
        evicted.append(key)
    slots = [slot for _, slot in victims]
    owners.clear(slots)
    return slots


def _oldest_not_in(
    items: Iterable[tuple[Any, int]], busy: set[int], n: int
) -> list[tuple[Any, int]]:
    """The first ``n`` of ``items`` whose slot is not in ``busy``."""
    out: list[tuple[Any, int]] = []
    if n <= 0:
        return out
    for item in items:
        if item[1] not in busy:
            out.append(item)
            if len(out) == n:
                break
    return out
