"""The host's disk tier as bookkeeping (``disk_tier.DiskTier`` over ``SharedCache``, a disk
that completes its I/O when polled): copies ahead of eviction, admission, keys announced on
disk, promotions, slots withheld while the disk still uses them; and the tier's copy of the
index (``SharedSlots``) holding keys announced on disk."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torch_kv_tier.index import BlockIndex
from torch_kv_tier.remote import shared_snapshot
from torch_kv_tier.remote.disk_tier import (
    COPY_BACKOFF_MAX_S,
    COPY_BACKOFF_S,
    COPY_IDLE_PERIOD_S,
    COPY_PERIOD_S,
    PROMOTE_BACKOFF_S,
    DiskTier,
    SeenCounts,
)
from torch_kv_tier.remote.leases import SlotPool
from torch_kv_tier.remote.protocol import ON_DISK
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


def _host(num_blocks: int = 8, disk_slots: int = 64, admit: int = 1) -> tuple[Any, ...]:
    cache = SharedCache(SlotPool(num_blocks), max_granted=num_blocks)
    disk = FakeDisk(disk_slots)
    tier = DiskTier(cache, disk, admit_after=admit)  # type: ignore[arg-type]
    cache.join("s", "ns")
    return cache, disk, tier


def _a_only_on_disk() -> tuple[Any, ...]:
    """A 4-slot host whose ``a`` left DRAM for its disk (``b`` to ``e`` in DRAM), its events
    taken."""
    cache, disk, tier = _host(num_blocks=4)
    _store(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)
    _store(cache, ["e"])  # a leaves DRAM for the disk
    _events(cache)
    return cache, disk, tier


def _store(cache: SharedCache, keys: list[Any]) -> None:
    slots = cache.grant("s", len(keys))
    assert len(slots) == len(keys)
    cache.commit("s", keys, slots, [hash(k) & 0xFFFF for k in keys])


def _events(cache: SharedCache) -> tuple[dict[Any, int], list[Any]]:
    stored: dict[Any, int] = {}
    evicted: list[Any] = []
    for _, _, keys, slots, _, gone in cache.take_events(1024):
        stored.update(zip(keys, slots))
        evicted += gone
    return stored, evicted


def test_keys_copied_ahead_leave_dram_as_on_disk_and_come_back_promoted() -> None:
    cache, disk, tier = _host()
    _store(cache, [f"k{i}" for i in range(8)])  # the pool is full: every key may be evicted
    tier.step(now=1.0)  # copies ahead of eviction posted
    tier.step(now=2.0)  # and completed
    assert len(disk.keys) == 8
    _events(cache)
    _store(cache, ["n0", "n1"])  # evicts k0 and k1, which the disk holds
    stored, evicted = _events(cache)
    assert stored["k0"] == stored["k1"] == ON_DISK and evicted == []
    assert stored["n0"] >= 0
    snapshot_keys, snapshot_slots, _, _ = shared_snapshot.whole(cache, "s")
    assert dict(zip(snapshot_keys, snapshot_slots))["k0"] == ON_DISK
    tier.promote(cache.namespace_of("s"), ["k0", "absent"], 3.0)
    tier.step(now=3.0)  # a DRAM slot taken (k2 evicted: on disk too), the read posted
    tier.step(now=4.0)  # the read completed: k0 published
    stored, _ = _events(cache)
    assert stored["k0"] >= 0 and stored["k2"] == ON_DISK
    assert cache.digest_of(stored["k0"]) == disk.keys[("ns", "k0")]
    assert tier.stats()["disk_promotions"] == 1


def test_a_key_being_copied_is_not_evicted_the_next_oldest_is() -> None:
    cache, disk, tier = _host(num_blocks=4)
    _store(cache, ["a", "b"])
    tier.step(now=1.0)  # copies of a and b in flight
    _store(cache, ["c", "d"])
    assert len(disk.busy_dram_slots()) == 2
    _events(cache)
    _store(cache, ["e", "f"])  # the pool is full: c and d go, a and b stay
    _, evicted = _events(cache)
    assert sorted(evicted) == ["c", "d"]
    assert disk.busy_dram_slots().isdisjoint(cache.namespace_of("s").entries[k] for k in "ef")
    tier.step(now=2.0)  # copies done
    _store(cache, ["g"])  # now a, the oldest, leaves for the disk
    stored, _ = _events(cache)
    assert stored["a"] == ON_DISK


def test_blocks_seen_once_stay_off_the_disk_by_default() -> None:
    cache, disk, tier = _host(admit=2)
    _store(cache, [f"k{i}" for i in range(8)])
    cache.touch("s", ["k3", "k4"])  # loaded once: seen twice
    tier.step(now=1.0)
    tier.step(now=2.0)
    assert sorted(k for _, k in disk.keys) == ["k3", "k4"]
    _events(cache)
    _store(cache, [f"n{i}" for i in range(8)])  # evicts all eight
    stored, evicted = _events(cache)
    assert {k for k, s in stored.items() if s == ON_DISK} == {"k3", "k4"}
    assert sorted(evicted) == sorted(f"k{i}" for i in range(8) if i not in (3, 4))


def test_a_disk_that_drops_a_key_announces_it_evicted() -> None:
    cache, disk, tier = _host(num_blocks=4, disk_slots=4)
    _store(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all four on disk
    _events(cache)
    _store(cache, ["e", "f", "g", "h"])  # evicts every key to the disk
    stored, evicted = _events(cache)
    assert all(stored[k] == ON_DISK for k in "abcd") and evicted == []
    tier.step(now=3.0)  # copies of e..h take the disk's room: a..d dropped
    stored, evicted = _events(cache)
    assert sorted(evicted) == ["a", "b", "c", "d"]


def test_a_failed_promotion_frees_its_slot_and_announces_the_key_evicted() -> None:
    cache, disk, tier = _a_only_on_disk()
    disk.fail_reads = True
    tier.promote(cache.namespace_of("s"), ["a"], 3.0)
    tier.step(now=3.0)
    tier.step(now=4.0)
    _, evicted = _events(cache)
    assert "a" in evicted
    assert cache.namespace_of("s").granted == 0
    assert tier.stats()["disk_promotions_failed"] == 1


@pytest.mark.parametrize("ends_failed", [False, True])
def test_a_promotion_the_disk_gave_up_withholds_its_slot_until_the_read_ends(
    ends_failed: bool,
) -> None:
    """Found by review: a disk read that hung was waited on forever (its promotion never
    failed, its slot stayed granted). A read the disk gives up fails the promotion, but its
    slot, which the read may still write, goes back to the pool only once the read ends.
    Found by the fifth disk review: the disk kept no key of a read given up, though its block
    was intact. Its key now stays announced on disk, promoted once the read ends, unless that
    read ended failed: the disk then drops it, announced evicted as the read ends."""
    cache, disk, tier = _a_only_on_disk()
    disk.hang_reads = True
    tier.promote(cache.namespace_of("s"), ["a"], 3.0)
    tier.step(now=3.0)  # a DRAM slot taken, the read posted
    tier.step(now=4.0)  # given up
    _, evicted = _events(cache)
    assert evicted == [] and tier.stats()["disk_promotions_failed"] == 1
    slot = disk.stuck[("ns", "a")]
    free_before = cache.free_slots()
    tier.step(now=5.0)
    assert cache.namespace_of("s").granted == 1 and cache.free_slots() == free_before
    disk.end_stuck(failed=ends_failed)
    tier.step(now=6.0)  # the read ended: the slot is free again
    assert cache.namespace_of("s").granted == 0 and cache.free_slots() == free_before + 1
    assert _events(cache)[1] == (["a"] if ends_failed else [])
    disk.hang_reads = False
    tier.promote(cache.namespace_of("s"), ["a"], 7.0)
    tier.step(now=7.0)
    tier.step(now=8.0)
    assert ("a" in cache.namespace_of("s").entries) is not ends_failed
    if ends_failed:
        assert slot in cache.grant("s", 1)


def test_a_promotion_of_a_key_in_a_hung_directory_evicts_nothing_and_waits_for_it() -> None:
    """Found by the fifth disk review: a promotion of a key whose directory hangs (a read
    there given up, still in flight) took a DRAM slot, evicting the least recently used key of
    a full pool (lost, if no disk copy could be made), for a read the disk refused at once. It
    now fails taking no slot, the key kept on disk, and is promoted once the directory answers."""
    cache, disk, tier = _a_only_on_disk()  # a on disk; the pool's 4 slots hold b to e
    ns = cache.namespace_of("s")
    held = dict(ns.entries)
    disk.hung_keys.add(("ns", "a"))
    tier.promote(ns, ["a"], 3.0)
    tier.step(now=3.0)
    tier.step(now=4.0)
    assert ns.entries == held and _events(cache) == ({}, [])  # nothing evicted, a on disk
    assert tier.stats()["disk_promotions_failed"] == 1 and disk.contains("ns", "a")
    disk.hung_keys.clear()  # the directory answers
    tier.promote(ns, ["a"], 5.0)
    tier.step(now=5.0)
    tier.step(now=6.0)
    assert "a" in ns.entries and tier.stats()["disk_promotions"] == 1


@pytest.mark.parametrize("reading", [False, True])
def test_a_key_stored_again_with_other_bytes_is_never_promoted_old(reading: bool) -> None:
    """Found by review: key a on disk (digest 1) and stored again with other bytes (digest 2:
    a tier that did not know it on disk; ``reading``: while its old copy was being read for a
    promotion, which then kept the new copy) kept its old disk copy; once the new one left
    DRAM, a was announced on disk again and promoted with the old bytes and their digest, which
    verify: the old version served as a hit after a newer store, with nothing between saying
    the key was gone."""
    cache, disk, tier = _host(num_blocks=4)
    ns = cache.namespace_of("s")
    _store(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all four on disk
    old = disk.keys[("ns", "a")]
    _store(cache, ["e"])  # a leaves DRAM for the disk
    if reading:
        tier.promote(ns, ["a"], 3.0)
        tier.step(now=3.0)  # the read of the old copy posted
    slot = cache.grant("s", 1)
    cache.commit("s", ["a"], slot, [old + 1])  # a's new bytes
    tier.step(now=4.0)  # the read (if any) completes: the new copy stays
    assert cache.digest_of(ns.entries["a"]) == old + 1
    tier.step(now=4.5)  # no copy in flight
    _store(cache, ["f", "g", "h", "i"])  # every older key leaves DRAM, then a
    tier.step(now=5.0)
    _events(cache)
    assert "a" not in ns.entries
    tier.promote(ns, ["a"], 6.0)
    tier.step(now=6.0)
    tier.step(now=7.0)
    assert "a" not in ns.entries or cache.digest_of(ns.entries["a"]) == old + 1


def test_a_failed_copy_of_a_key_being_promoted_keeps_its_slot_granted_until_the_read_ends() -> None:
    """Found by review: key a's promotion reading its old disk copy into a DRAM slot, a stored
    again with other bytes (its old copy dropped) and its copy ahead failing (EIO, full) before
    that read ended: the failed copy was taken for the promotion's failure, whose DRAM slot went
    back to the free list while the disk still read into it, and the next grant handed it to a
    writer (or ``return_free`` to a private lease), whose bytes the late read then overwrote. A
    failure ends a promotion only when it is its read's (its DRAM slot)."""
    cache, disk, tier = _a_only_on_disk()  # a on disk; b, c, d (on disk too) and e in DRAM
    ns = cache.namespace_of("s")
    disk.hold_reads = True
    tier.promote(ns, ["a"], 3.0)
    tier.step(now=3.0)  # a DRAM slot taken, the read of a's old copy posted
    (reading,) = disk.reading.values()
    cache.commit("s", ["a"], cache.grant("s", 1), [disk.keys[("ns", "a")] + 1])  # new bytes
    assert not disk.contains("ns", "a")
    tier.step(now=3.1)  # the copy of a's new bytes posted
    assert ("ns", "a") in disk.writing
    disk.fail_writes = True
    tier.step(now=3.2)  # ...and failed; the read still in flight
    assert disk.reading == {("ns", "a"): reading}
    assert ns.granted == 1 and tier.stats()["disk_promotions_failed"] == 0
    granted = cache.grant("s", 4)  # evicts every key in DRAM
    assert reading not in granted  # never handed out while the disk writes it
    disk.hold_reads = False
    tier.step(now=3.3)  # the read ends (a's old copy dropped: failed): its slot is free again
    assert not disk.reading and tier.stats()["disk_promotions_failed"] == 1
    assert ns.granted == len(granted) == 3
    cache.join("o", "ns")
    assert cache.grant("o", 1) == [reading]


def test_a_promotion_that_finds_no_dram_slot_is_tried_again() -> None:
    cache, disk, tier = _host(num_blocks=4)
    _store(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all four on disk
    granted = cache.grant("s", 4)  # every slot granted, uncommitted: nothing to evict
    assert len(granted) == 4
    tier.promote(cache.namespace_of("s"), ["a"], 3.0)
    tier.step(now=3.0)
    assert tier.retry_in(3.0) < math.inf and not disk.reading  # waiting for a slot
    cache.commit("s", ["e", "f", "g", "h"], granted, [1, 2, 3, 4])  # evictable again
    tier.step(now=4.0)
    tier.step(now=4.1)
    stored, _ = _events(cache)
    assert stored["a"] >= 0 and tier.stats()["disk_promotions"] == 1
    tier.promote(cache.namespace_of("s"), ["b"], 5.0)
    cache.grant("s", 4)  # all granted again
    tier.step(now=5.0)
    tier.step(now=11.0)  # given up after PROMOTE_RETRY_S
    assert tier.retry_in(11.0) == math.inf and tier.stats()["disk_promotions_without_slot"] == 1


def _a_namespace_only_on_disk() -> tuple[Any, ...]:
    """Namespace "ns" (session "s") whose eight keys all left DRAM for the disk: namespace
    "other" (session "o") filled the pool."""
    cache, disk, tier = _host()
    _store(cache, [f"k{i}" for i in range(8)])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all eight on disk
    cache.join("o", "other")
    cache.commit("o", [f"o{i}" for i in range(8)], cache.grant("o", 8), list(range(8)))
    _events(cache)
    assert not cache.namespace_of("s").entries and disk.contains("ns", "k0")
    return cache, disk, tier


def test_a_promotion_of_a_namespace_whose_last_session_left_is_dropped() -> None:
    """Found by review: a promotion asked right before its namespace's last session left was
    published into the forgotten namespace; the eviction that later reached the key raised
    ``KeyError`` in the server's loop (the host died), having lost the slot."""
    cache, disk, tier = _a_namespace_only_on_disk()
    tier.promote(cache.namespace_of("s"), ["k0"], 3.0)
    cache.leave("s", 3.0, clean=True)
    assert "ns" not in cache.namespaces
    tier.step(now=3.0)
    tier.step(now=3.1)
    assert not disk.reading and not tier.busy()
    cache.touch("o", [f"o{i}" for i in range(8)])
    assert len(cache.grant("o", 8)) == 8  # evicts only "other"'s keys, each once
    assert cache.stored + cache.granted + cache.free_slots() == 8


def test_a_promotion_asked_before_its_namespace_was_joined_again_lands_in_the_new_one() -> None:
    """The same, with a new session joining the namespace before the promotion starts: the key
    is promoted into the namespace the new session sees, and no slot is lost."""
    cache, disk, tier = _a_namespace_only_on_disk()
    tier.promote(cache.namespace_of("s"), ["k0"], 3.0)
    cache.leave("s", 3.0, clean=True)
    cache.join("s2", "ns")
    tier.admit_after = 1000  # no copies ahead: their slots could not be evicted
    tier.step(now=3.0)
    tier.step(now=3.1)
    assert "k0" in cache.namespace_of("s2").entries
    cache.leave("s2", 4.0, clean=True)
    cache.leave("o", 4.0, clean=True)
    assert cache.stored + cache.granted + cache.held.blocks + cache.free_slots() == 8


def test_no_copy_ahead_starts_while_promotions_keep_more_than_its_share_busy() -> None:
    """Found by review: with promotions' reads keeping more DRAM slots busy than the copies'
    share (1/8 of the pool, at least 16), the budget went negative and ``items[:budget]``
    posted all but the last few copies: 60 of 64 slots busy, none evictable for grants."""
    cache, disk, tier = _host(num_blocks=64, disk_slots=1024)
    keys = [f"k{i}" for i in range(64)]
    _store(cache, keys)
    now = 1.0
    while len(disk.keys) < 64 or disk.writing:
        assert now < 1000.0, "64 keys not copied to disk in 1000 steps"
        tier.step(now=now)
        now += 1.0
    tier.admit_after = 1000  # nothing admitted: no copy before the promotions below
    _store(cache, [f"n{i}" for i in range(64)])  # every k* leaves DRAM for the disk
    tier.step(now=now)
    tier.admit_after = 1
    tier.promote(cache.namespace_of("s"), keys[:20], now)
    tier.step(now=now + 1.0)
    assert len(disk.reading) == 20 and not disk.writing


def test_seen_counts_count_per_namespace_and_age() -> None:
    counts = SeenCounts()
    counts.add("x", [b"a", b"a", b"b"])  # a batch counts a key once
    counts.add("x", [b"a"])
    assert counts.counts("x", [b"a", b"b", b"c"]).tolist() == [2, 1, 0]
    assert counts.counts("y", [b"a"]).tolist() == [0]
    counts._added = SeenCounts.AGE_EVERY - 1
    counts.add("x", [b"d"])
    assert counts.counts("x", [b"a", b"d"]).tolist() == [1, 0]


def test_disk_admit_must_be_positive() -> None:
    cache = SharedCache(SlotPool(4))
    with pytest.raises(ValueError, match="--disk-admit"):
        DiskTier(cache, FakeDisk(4), admit_after=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("compact", [False, True], ids=["dict-copy", "compact-copy"])
def test_a_tiers_copy_counts_keys_on_disk_and_forgets_them_when_promoted(compact: bool) -> None:
    index = BlockIndex(compact=compact)
    peer = index.add_shared_peer("host", 16)
    index.apply_host_changes(peer, [b"a", b"b", b"c"], [3, ON_DISK, ON_DISK], [7, 0, 0], [], True)
    assert index.lookup([b"a", b"b", b"c", b"d"]) == 3
    assert index.holder(b"b") is None and index.disk_holder(b"b") is peer
    assert index.on_disk([b"a", b"b", b"c"]) == {peer: [1, 2]}
    groups, missing = index.locate([b"a", b"b"], [0, 1])
    assert missing == [b"b"]
    index.apply_host_changes(peer, [b"b"], [5], [9], [b"c"], False)  # promoted; c dropped
    assert index.holder(b"b") is peer and not index.has_disk_keys()
    assert index.lookup([b"a", b"b", b"c"]) == 2
    index.apply_host_changes(peer, [b"a"], [ON_DISK], [0], [], False)  # a left DRAM
    assert index.holder(b"a") is None and index.disk_holder(b"a") is peer


_JOIN_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "touch", "step", "promote", "other", "events"]),
        st.integers(0, 11),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_JOIN_OPS, _JOIN_OPS)
@example(  # stored again into a slot the walk had not reached: not found twice
    [("store", 2), ("store", 0), ("step", 0), ("step", 0)],
    [("store", 8), ("events", 1), ("store", 1)],
)
@example(  # copied to the disk again after the walk began: not found twice
    [],
    [("store", 0), ("store", 2), ("step", 0), ("step", 0), ("store", 2), ("events", 1)]
    + [("store", 11), ("step", 0), ("step", 0), ("store", 2), ("store", 1)],
)
def test_a_joining_tiers_copy_is_the_hosts_index_whatever_changed_while_its_pages_were_walked(
    before: list[tuple[str, int]], during: list[tuple[str, int]]
) -> None:
    """A snapshot is walked a slot per page here (``shared_snapshot``), with stores, evictions,
    copies to disk, the disk's evictions, promotions and other namespaces' stores between its
    pages: its pages name no key twice, and with the events numbered after it applied as a
    tier applies them (``replica``), the copy is exactly the host's index, slots and digests."""
    cache, disk, tier = _host(num_blocks=6, disk_slots=8)
    cache.join("t", "ns")  # the tier that joins
    cache.join("o", "other")
    batches: list[Any] = []
    clock = iter(range(1, 1000))

    def change(op: str, n: int) -> None:
        if op in ("store", "other"):
            sid = "s" if op == "store" else "o"
            keys = [f"k{(n + i) % 12}" for i in range(1 + n % 3)]
            slots = cache.grant(sid, len(keys))
            cache.commit(sid, keys[: len(slots)], slots, [next(clock) for _ in slots])
        elif op == "touch":
            cache.touch("s", [f"k{n}"])
        elif op == "step":
            tier.step(now=float(next(clock)))
        elif op == "promote":
            tier.promote(cache.namespace_of("s"), [f"k{n}"], float(next(clock)))
        else:
            batches.extend(cache.take_events(max_keys=3))

    for op, n in before:
        change(op, n)
    with (
        mock.patch.object(shared_snapshot, "CHUNK", 1),
        mock.patch.object(shared_snapshot, "SCAN_SLOTS", 1),
        mock.patch.object(shared_snapshot, "MAX_WALK", 1),
    ):
        snap = cache.begin_snapshot("t")
        pages = []
        for op, n in during:
            if op == "events" and n % 2 and not snap.done:  # a page asked instead
                pages.append(cache.snapshot_part(snap))
            else:
                change(op, n)
        while not snap.done:
            pages.append(cache.snapshot_part(snap))
    batches.extend(cache.take_events(max_keys=3))

    found = [key for keys, _, _ in pages for key in keys]
    assert len(found) == len(set(found)), found
    copy = {k: (s, d) for page in pages for k, s, d in zip(*page)}
    for ns, seq, stored, slots, digests, evicted in batches:
        if ns.name == "ns" and seq > snap.event_seq:
            for key in evicted:
                copy.pop(key, None)
            copy.update({k: (s, d) for k, s, d in zip(stored, slots, digests)})
    entries = cache.namespace_of("t").entries
    host = {k: (s, cache.digest_of(s)) for k, s in entries.items()}
    host.update({k: (ON_DISK, 0) for name, k in disk.keys if name == "ns" and k not in entries})
    assert copy == host


def test_a_look_for_copies_that_found_none_is_repeated_once_the_window_moved_not_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: with the pool full and its least recently used keys on disk already or
    not admitted (seen once: most keys, with the default ``--disk-admit 2``), every step looked
    over the whole window again (8192 keys at the default grant size: 3 ms) every
    ``COPY_PERIOD_S`` (2 ms), so a busy host's loop spent most of its time there. A look that
    found nothing is now repeated once as many keys as half the window were evicted or used
    (new keys in it), or after ``COPY_IDLE_PERIOD_S`` (a key there seen again)."""
    cache, disk, tier = _host(num_blocks=64, disk_slots=1024, admit=2)
    _store(cache, [f"k{i}" for i in range(64)])  # seen once each: none admitted
    looks: list[int] = []
    real = cache.oldest
    monkeypatch.setattr(cache, "oldest", lambda n: looks.append(n) or real(n))
    now = 1.0
    for _ in range(10):
        tier.step(now=now)
        now += COPY_PERIOD_S
    assert len(looks) == 1
    tier.step(now=1.0 + COPY_IDLE_PERIOD_S)
    assert len(looks) == 2
    window, now = looks[0], 1.0 + COPY_IDLE_PERIOD_S
    _store(cache, [f"n{i}" for i in range(window // 4)])  # as many evicted, and seen
    tier.step(now=now + COPY_PERIOD_S)
    assert len(looks) == 3
    cache.touch("s", [f"x{i}" for i in range(window // 4)])  # a quarter of the window seen...
    tier.step(now=now + 2 * COPY_PERIOD_S)
    assert len(looks) == 3
    cache.touch("s", [f"y{i}" for i in range(window // 4)])  # ...and another quarter
    tier.step(now=now + 3 * COPY_PERIOD_S)
    assert len(looks) == 4 and not disk.writing


def test_a_pool_smaller_than_the_copy_window_copies_every_key_it_evicts() -> None:
    """Found by the host review: over a pool of fewer slots than ``MIN_SPILL_WINDOW`` (256), a
    look for copies that found none waited for 128 keys moved (half the window), four times
    this 32-slot pool, or ``COPY_IDLE_PERIOD_S``: the keys stored meanwhile were evicted with
    no copy (72 of 128). The window is now at most the pool."""
    cache = SharedCache(SlotPool(32), max_granted=8)
    disk = FakeDisk(1024)
    tier = DiskTier(cache, disk, admit_after=1)  # type: ignore[arg-type]
    cache.join("s", "ns")
    now, lost = 1.0, []
    for i in range(0, 160, 8):  # a grant's worth at a time, the loop stepping between
        _store(cache, [f"k{j}" for j in range(i, i + 8)])
        for _ in range(3):
            tier.step(now=now)
            now += COPY_PERIOD_S
        lost += _events(cache)[1]
    assert lost == [] and len(disk.keys) == 160


def test_a_promotion_waiting_for_a_slot_is_retried_once_one_may_be_free_not_every_step() -> None:
    """A promotion that found no DRAM slot was tried again at every step, each time O(keys
    asked), and kept the loop polling every ``DISK_POLL_S`` for 5 s: a host burning its loop
    (every tier's control plane). It is tried again once a slot may have come free (here a
    commit), else after ``PROMOTE_BACKOFF_S``, and the loop may sleep meanwhile."""
    cache, disk, tier = _host(num_blocks=4)
    ns = cache.namespace_of("s")
    _store(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all four on disk
    granted = cache.grant("s", 4)  # every slot granted, uncommitted: nothing to evict
    tier.promote(ns, ["a"], 3.0)
    with mock.patch.object(cache, "take_for", wraps=cache.take_for) as take:
        for i in range(80):  # 40 ms of a loop polling every 0.5 ms, nothing freed
            tier.step(now=3.0 + i * 0.0005)
        assert take.call_count == 1 and not tier.busy()  # the loop may sleep...
        assert 0 < tier.retry_in(3.04) <= PROMOTE_BACKOFF_S  # ...until the backoff's end
        tier.promote(ns, ["a"], 3.045)  # asked again (a tier asks every second): tried...
        tier.step(now=3.045)
        assert take.call_count == 2 and len(tier._waiting) == 1  # ...and waiting once
        assert tier.retry_in(3.045) == pytest.approx(3.0 + PROMOTE_BACKOFF_S - 3.045)
        tier.step(now=3.0 + PROMOTE_BACKOFF_S)
        assert take.call_count == 3 and not disk.reading  # the backoff: still no slot
        cache.commit("s", ["e", "f", "g", "h"], granted, [1, 2, 3, 4])  # evictable again
        tier.step(now=3.06)  # at once, not at the backoff's end
        assert take.call_count == 4 and disk.reading
    tier.step(now=3.07)
    assert _events(cache)[0]["a"] >= 0 and tier.retry_in(3.07) == math.inf


def test_a_failed_copy_wakes_a_promotion_waiting_for_its_slot_at_once() -> None:
    """A promotion that found no DRAM slot because the only evictable one was being copied was
    woken by a completed copy, not by a failed one: it waited for ``PROMOTE_BACKOFF_S``. A
    failed copy frees its slot for eviction just as well: the next step promotes into it, with
    the promoted key's bytes, and the key whose copy failed is evicted, not announced on disk."""
    cache, disk, tier = _a_only_on_disk()  # a on disk; b, c, d (on disk too) and e in DRAM
    ns = cache.namespace_of("s")
    cache.grant("s", 3)  # evicts b, c, d: e is the only key in DRAM, and not on disk
    disk.hold_writes = True
    tier.step(now=3.0)
    assert disk.writing.keys() == {("ns", "e")}  # e is being copied: not evictable
    tier.promote(ns, ["a"], 3.0)
    tier.step(now=3.0)
    assert tier.retry_in(3.0) < math.inf and not disk.reading  # waiting for a slot
    disk.hold_writes, disk.fail_writes = False, True
    tier.step(now=3.001)  # the copy fails: e's slot is evictable, a is read into it at once
    assert disk.reading.keys() == {("ns", "a")}
    tier.step(now=3.002)
    stored, evicted = _events(cache)
    assert "e" in evicted and not disk.contains("ns", "e")
    assert stored["a"] == ns.entries["a"] and cache.digest_of(stored["a"]) == disk.digest("ns", "a")
    assert tier.retry_in(3.002) == math.inf and cache.granted == 3  # no slot left behind


def test_copies_to_a_failing_disk_back_off_bounded_and_resume_once_one_is_done() -> None:
    """Found by review: a disk whose every write failed (EIO, full) was written again at every
    look for copies (every ``COPY_PERIOD_S``: 3200 blocks failed in 200 loop turns where 80 do
    now). Copies that all failed are now looked for again after a backoff that doubles up to
    ``COPY_BACKOFF_MAX_S``; a copy done ends it."""
    cache, disk, tier = _host()
    _store(cache, [f"k{i}" for i in range(8)])
    disk.fail_writes = True
    with mock.patch.object(disk, "write", wraps=disk.write) as write:
        now, backoff = 1.0, COPY_BACKOFF_S
        tier.step(now)  # copies posted...
        for _ in range(12):
            failed = now + 0.001
            tier.step(failed)  # ...and failed: backed off
            posted = write.call_count
            for t in range(1, 10):  # every loop turn until the backoff ends: no copy
                tier.step(failed + backoff * t / 10)
            assert write.call_count == posted
            now = failed + backoff
            tier.step(now)  # the backoff's end: copies posted again
            assert write.call_count == posted + 1
            assert tier.stats()["disk_keys"] == 0
            backoff = min(COPY_BACKOFF_MAX_S, 2 * backoff)
        assert backoff == COPY_BACKOFF_MAX_S  # bounded
        disk.fail_writes = False
        tier.step(now + 0.001)  # copies done: the backoff ends
        assert len(disk.keys) == 8
        _store(cache, ["n0"])  # k0 leaves DRAM, on disk
        tier.step(now + 0.002)  # the next look is not backed off
        assert write.call_count == posted + 2


def test_slot_owners_pick_a_namespaces_slots_written_before_a_stamp_and_holding_it_now() -> None:
    owners = SlotOwners(6)
    owners.record([0, 1, 2], [("a", "k0"), ("b", "k1"), ("a", "k2")])
    stamp = owners.count
    owners.clear([2])
    owners.record([2, 3], [("b", "k3"), ("a", "k4")])  # after the stamp: not walked
    owners.clear([1])
    assert owners.held_by(0, 6, stamp, "a") == ([0], 2)
    assert owners.held_by(0, 6, stamp, "b") == ([], 2)
    assert owners.held_by(1, 6, owners.count, "a") == ([3], 3)
    assert owners.held_by(0, 6, owners.count, "never recorded") == ([], 4)
