"""The host's disk tier's promotions (``disk_tier.DiskTier`` over ``SharedCache``, a disk that
completes its I/O when polled: ``disk_tier_support.FakeDisk``): keys read back from disk into
DRAM, slots withheld while the disk still uses them, promotions that fail, wait for a slot, or
outlive their namespace."""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import pytest
from disk_tier_support import a_only_on_disk, disk_host, events_of, store_keys

from torch_kv_tier.remote.disk_tier import (
    PROMOTE_BACKOFF_S,
)


def test_a_failed_promotion_frees_its_slot_and_announces_the_key_evicted() -> None:
    cache, disk, tier = a_only_on_disk()
    disk.fail_reads = True
    tier.promote(cache.namespace_of("s"), ["a"], 3.0)
    tier.step(now=3.0)
    tier.step(now=4.0)
    _, evicted = events_of(cache)
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
    cache, disk, tier = a_only_on_disk()
    disk.hang_reads = True
    tier.promote(cache.namespace_of("s"), ["a"], 3.0)
    tier.step(now=3.0)  # a DRAM slot taken, the read posted
    tier.step(now=4.0)  # given up
    _, evicted = events_of(cache)
    assert evicted == [] and tier.stats()["disk_promotions_failed"] == 1
    slot = disk.stuck[("ns", "a")]
    free_before = cache.free_slots()
    tier.step(now=5.0)
    assert cache.namespace_of("s").granted == 1 and cache.free_slots() == free_before
    disk.end_stuck(failed=ends_failed)
    tier.step(now=6.0)  # the read ended: the slot is free again
    assert cache.namespace_of("s").granted == 0 and cache.free_slots() == free_before + 1
    assert events_of(cache)[1] == (["a"] if ends_failed else [])
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
    cache, disk, tier = a_only_on_disk()  # a on disk; the pool's 4 slots hold b to e
    ns = cache.namespace_of("s")
    held = dict(ns.entries)
    disk.hung_keys.add(("ns", "a"))
    tier.promote(ns, ["a"], 3.0)
    tier.step(now=3.0)
    tier.step(now=4.0)
    assert ns.entries == held and events_of(cache) == ({}, [])  # nothing evicted, a on disk
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
    cache, disk, tier = disk_host(num_blocks=4)
    ns = cache.namespace_of("s")
    store_keys(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all four on disk
    old = disk.keys[("ns", "a")]
    store_keys(cache, ["e"])  # a leaves DRAM for the disk
    if reading:
        tier.promote(ns, ["a"], 3.0)
        tier.step(now=3.0)  # the read of the old copy posted
    slot = cache.grant("s", 1)
    cache.commit("s", ["a"], slot, [old + 1])  # a's new bytes
    tier.step(now=4.0)  # the read (if any) completes: the new copy stays
    assert cache.digest_of(ns.entries["a"]) == old + 1
    tier.step(now=4.5)  # no copy in flight
    store_keys(cache, ["f", "g", "h", "i"])  # every older key leaves DRAM, then a
    tier.step(now=5.0)
    events_of(cache)
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
    cache, disk, tier = a_only_on_disk()  # a on disk; b, c, d (on disk too) and e in DRAM
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
    cache, disk, tier = disk_host(num_blocks=4)
    store_keys(cache, ["a", "b", "c", "d"])
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
    stored, _ = events_of(cache)
    assert stored["a"] >= 0 and tier.stats()["disk_promotions"] == 1
    tier.promote(cache.namespace_of("s"), ["b"], 5.0)
    cache.grant("s", 4)  # all granted again
    tier.step(now=5.0)
    tier.step(now=11.0)  # given up after PROMOTE_RETRY_S
    assert tier.retry_in(11.0) == math.inf and tier.stats()["disk_promotions_without_slot"] == 1


def _a_namespace_only_on_disk() -> tuple[Any, ...]:
    """Namespace "ns" (session "s") whose eight keys all left DRAM for the disk: namespace
    "other" (session "o") filled the pool."""
    cache, disk, tier = disk_host()
    store_keys(cache, [f"k{i}" for i in range(8)])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all eight on disk
    cache.join("o", "other")
    cache.commit("o", [f"o{i}" for i in range(8)], cache.grant("o", 8), list(range(8)))
    events_of(cache)
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


def test_a_promotion_waiting_for_a_slot_is_retried_once_one_may_be_free_not_every_step() -> None:
    """A promotion that found no DRAM slot was tried again at every step, each time O(keys
    asked), and kept the loop polling every ``DISK_POLL_S`` for 5 s: a host burning its loop
    (every tier's control plane). It is tried again once a slot may have come free (here a
    commit), else after ``PROMOTE_BACKOFF_S``, and the loop may sleep meanwhile."""
    cache, disk, tier = disk_host(num_blocks=4)
    ns = cache.namespace_of("s")
    store_keys(cache, ["a", "b", "c", "d"])
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
    assert events_of(cache)[0]["a"] >= 0 and tier.retry_in(3.07) == math.inf


def test_a_failed_copy_wakes_a_promotion_waiting_for_its_slot_at_once() -> None:
    """A promotion that found no DRAM slot because the only evictable one was being copied was
    woken by a completed copy, not by a failed one: it waited for ``PROMOTE_BACKOFF_S``. A
    failed copy frees its slot for eviction just as well: the next step promotes into it, with
    the promoted key's bytes, and the key whose copy failed is evicted, not announced on disk."""
    cache, disk, tier = a_only_on_disk()  # a on disk; b, c, d (on disk too) and e in DRAM
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
    stored, evicted = events_of(cache)
    assert "e" in evicted and not disk.contains("ns", "e")
    assert stored["a"] == ns.entries["a"] and cache.digest_of(stored["a"]) == disk.digest("ns", "a")
    assert tier.retry_in(3.002) == math.inf and cache.granted == 3  # no slot left behind
