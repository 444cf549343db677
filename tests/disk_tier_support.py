"""The host's disk tier's tests without a disk (``test_disk_tier``, ``test_disk_promotions``,
``test_disk_tier_index``): ``FakeDisk``, ``DiskStore``'s interface in memory, and a host over it
(a ``SharedCache`` with its ``DiskTier``), keys stored and events taken."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_kv_tier.remote.disk_tier import DiskTier
from torch_kv_tier.remote.leases import SlotPool
from torch_kv_tier.remote.shared_cache import SharedCache
from torch_kv_tier.remote.slot_owners import SlotOwners


@dataclass
class Completions:
    written: list[tuple[str, Any]] = field(default_factory=list)
    read: list[tuple[str, Any, int, int]] = field(default_factory=list)
    failed: list[tuple[str, Any, int]] = field(default_factory=list)
    abandoned: list[tuple[str, Any, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)


class FakeDisk:
    """``DiskStore``'s interface in memory: I/O posted now completes at the next ``poll``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: dict[tuple[str, Any], int] = {}  # (namespace, key) -> digest, LRU order
        self.owners = SlotOwners(capacity)  # the slot of each key in ``keys``
        self._slot: dict[tuple[str, Any], int] = {}
        self.writing: dict[tuple[str, Any], tuple[int, int]] = {}  # -> (digest, dram slot)
        self.reading: dict[tuple[str, Any], int] = {}  # -> dram slot
        self.fail_reads = False
        self.fail_writes = False
        self.hold_writes = False  # writes posted stay in flight across polls
        self.hold_reads = False  # reads posted stay in flight across polls
        self.hang_reads = False  # reads posted now are given up at the next poll, keys kept...
        self.stuck: dict[tuple[str, Any], int] = {}  # ...and end at ``end_stuck`` (-> dram slot)
        self.ended: list[int] = []
        self.hung_keys: set[tuple[str, Any]] = set()  # in a directory that hangs: reads refused

    def contains(self, namespace: str, key: Any) -> bool:
        return (namespace, key) in self.keys

    def hung(self, namespace: str, key: Any) -> bool:
        return (namespace, key) in self.hung_keys and self.contains(namespace, key)

    def digest(self, namespace: str, key: Any) -> int | None:
        return self.keys.get((namespace, key))

    def remove(self, namespace: str, key: Any) -> bool:
        return self._forget((namespace, key))

    def slot_owners(self) -> SlotOwners:
        return self.owners

    def _forget(self, pair: tuple[str, Any]) -> bool:
        if self.keys.pop(pair, None) is None:
            return False
        self.owners.clear([self._slot.pop(pair)])
        return True

    def busy_dram_slots(self) -> set[int]:
        busy = {s for _, s in self.writing.values()} | set(self.reading.values())
        return busy | set(self.stuck.values())

    def in_flight(self) -> int:
        return int(bool(self.writing or self.reading))

    def compacting(self) -> bool:
        return False

    def write(self, items: list[tuple[str, Any, int, int]]) -> list[tuple[str, Any]]:
        evicted = []
        for ns, key, digest, slot in items:
            if (ns, key) in self.keys or (ns, key) in self.writing:
                continue
            if len(self.keys) + len(self.writing) >= self.capacity:
                if not self.keys:  # every slot has a write in flight
                    continue
                victim = next(iter(self.keys))
                self._forget(victim)
                evicted.append(victim)
            self.writing[(ns, key)] = (digest, slot)
        return evicted

    def read(self, items: list[tuple[str, Any, int]]) -> list[tuple[str, Any]]:
        skipped = []
        for ns, key, slot in items:
            if (ns, key) not in self.keys:
                skipped.append((ns, key))
            else:
                self.reading[(ns, key)] = slot
        return skipped

    def end_stuck(self, *, failed: bool = False) -> None:
        """The reads given up end (``failed``: their keys dropped, as ``DiskStore`` does)."""
        for pair in self.stuck if failed else ():
            self._forget(pair)
        self.ended += self.stuck.values()
        self.stuck = {}

    def poll(self) -> Completions:
        done = Completions(released=self.ended)
        self.ended = []
        writes, self.writing = ({}, self.writing) if self.hold_writes else (self.writing, {})
        for (ns, key), (digest, dram) in writes.items():
            if self.fail_writes:
                done.failed.append((ns, key, dram))
                continue
            self.keys[(ns, key)] = digest
            taken = set(self._slot.values())
            self._slot[(ns, key)] = slot = next(s for s in range(self.capacity) if s not in taken)
            self.owners.record([slot], [(ns, key)])
            done.written.append((ns, key))
        for (ns, key), slot in {} if self.hold_reads else self.reading.items():
            if self.hang_reads:
                self.stuck[(ns, key)] = slot
                done.abandoned.append((ns, key, slot))
            elif (ns, key) in self.hung_keys:  # refused: the key kept
                done.failed.append((ns, key, slot))
            elif self.fail_reads or (ns, key) not in self.keys:  # removed meanwhile: old bytes
                self._forget((ns, key))
                done.failed.append((ns, key, slot))
            else:
                done.read.append((ns, key, slot, self.keys[(ns, key)]))
        if not self.hold_reads:
            self.reading = {}
        return done

    def stats(self) -> dict[str, Any]:
        return {"disk_keys": len(self.keys)}

    def close(self) -> None:
        pass


def disk_host(num_blocks: int = 8, disk_slots: int = 64, admit: int = 1) -> tuple[Any, ...]:
    cache = SharedCache(SlotPool(num_blocks), max_granted=num_blocks)
    disk = FakeDisk(disk_slots)
    tier = DiskTier(cache, disk, admit_after=admit)  # type: ignore[arg-type]
    cache.join("s", "ns")
    return cache, disk, tier


def a_only_on_disk() -> tuple[Any, ...]:
    """A 4-slot host whose ``a`` left DRAM for its disk (``b`` to ``e`` in DRAM), its events
    taken."""
    cache, disk, tier = disk_host(num_blocks=4)
    store_keys(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)
    store_keys(cache, ["e"])  # a leaves DRAM for the disk
    events_of(cache)
    return cache, disk, tier


def store_keys(cache: SharedCache, keys: list[Any]) -> None:
    slots = cache.grant("s", len(keys))
    assert len(slots) == len(keys)
    cache.commit("s", keys, slots, [hash(k) & 0xFFFF for k in keys])


def events_of(cache: SharedCache) -> tuple[dict[Any, int], list[Any]]:
    stored: dict[Any, int] = {}
    evicted: list[Any] = []
    for _, _, keys, slots, _, gone in cache.take_events(1024):
        stored.update(zip(keys, slots))
        evicted += gone
    return stored, evicted
