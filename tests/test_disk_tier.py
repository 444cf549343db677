"""The host's disk tier as bookkeeping (``disk_tier.DiskTier`` over ``SharedCache``, a disk
that completes its I/O when polled: ``disk_tier_support.FakeDisk``): copies ahead of eviction,
admission, keys announced on disk, copies backing off from a failing disk. Promotions are
``test_disk_promotions``'s, the tier's copy of the index ``test_disk_tier_index``'s."""

from __future__ import annotations

from unittest import mock

import pytest
from disk_tier_support import FakeDisk, disk_host, events_of, store_keys

from torch_kv_tier.remote import shared_snapshot
from torch_kv_tier.remote.disk_tier import (
    COPY_BACKOFF_MAX_S,
    COPY_BACKOFF_S,
    COPY_IDLE_PERIOD_S,
    COPY_PERIOD_S,
    DiskTier,
    SeenCounts,
)
from torch_kv_tier.remote.leases import SlotPool
from torch_kv_tier.remote.protocol import ON_DISK
from torch_kv_tier.remote.shared_cache import SharedCache


def test_keys_copied_ahead_leave_dram_as_on_disk_and_come_back_promoted() -> None:
    cache, disk, tier = disk_host()
    store_keys(cache, [f"k{i}" for i in range(8)])  # the pool is full: every key may be evicted
    tier.step(now=1.0)  # copies ahead of eviction posted
    tier.step(now=2.0)  # and completed
    assert len(disk.keys) == 8
    events_of(cache)
    store_keys(cache, ["n0", "n1"])  # evicts k0 and k1, which the disk holds
    stored, evicted = events_of(cache)
    assert stored["k0"] == stored["k1"] == ON_DISK and evicted == []
    assert stored["n0"] >= 0
    snapshot_keys, snapshot_slots, _, _ = shared_snapshot.whole(cache, "s")
    assert dict(zip(snapshot_keys, snapshot_slots))["k0"] == ON_DISK
    tier.promote(cache.namespace_of("s"), ["k0", "absent"], 3.0)
    tier.step(now=3.0)  # a DRAM slot taken (k2 evicted: on disk too), the read posted
    tier.step(now=4.0)  # the read completed: k0 published
    stored, _ = events_of(cache)
    assert stored["k0"] >= 0 and stored["k2"] == ON_DISK
    assert cache.digest_of(stored["k0"]) == disk.keys[("ns", "k0")]
    assert tier.stats()["disk_promotions"] == 1


def test_a_key_being_copied_is_not_evicted_the_next_oldest_is() -> None:
    cache, disk, tier = disk_host(num_blocks=4)
    store_keys(cache, ["a", "b"])
    tier.step(now=1.0)  # copies of a and b in flight
    store_keys(cache, ["c", "d"])
    assert len(disk.busy_dram_slots()) == 2
    events_of(cache)
    store_keys(cache, ["e", "f"])  # the pool is full: c and d go, a and b stay
    _, evicted = events_of(cache)
    assert sorted(evicted) == ["c", "d"]
    assert disk.busy_dram_slots().isdisjoint(cache.namespace_of("s").entries[k] for k in "ef")
    tier.step(now=2.0)  # copies done
    store_keys(cache, ["g"])  # now a, the oldest, leaves for the disk
    stored, _ = events_of(cache)
    assert stored["a"] == ON_DISK


def test_blocks_seen_once_stay_off_the_disk_by_default() -> None:
    cache, disk, tier = disk_host(admit=2)
    store_keys(cache, [f"k{i}" for i in range(8)])
    cache.touch("s", ["k3", "k4"])  # loaded once: seen twice
    tier.step(now=1.0)
    tier.step(now=2.0)
    assert sorted(k for _, k in disk.keys) == ["k3", "k4"]
    events_of(cache)
    store_keys(cache, [f"n{i}" for i in range(8)])  # evicts all eight
    stored, evicted = events_of(cache)
    assert {k for k, s in stored.items() if s == ON_DISK} == {"k3", "k4"}
    assert sorted(evicted) == sorted(f"k{i}" for i in range(8) if i not in (3, 4))


def test_a_disk_that_drops_a_key_announces_it_evicted() -> None:
    cache, disk, tier = disk_host(num_blocks=4, disk_slots=4)
    store_keys(cache, ["a", "b", "c", "d"])
    tier.step(now=1.0)
    tier.step(now=2.0)  # all four on disk
    events_of(cache)
    store_keys(cache, ["e", "f", "g", "h"])  # evicts every key to the disk
    stored, evicted = events_of(cache)
    assert all(stored[k] == ON_DISK for k in "abcd") and evicted == []
    tier.step(now=3.0)  # copies of e..h take the disk's room: a..d dropped
    stored, evicted = events_of(cache)
    assert sorted(evicted) == ["a", "b", "c", "d"]


def test_no_copy_ahead_starts_while_promotions_keep_more_than_its_share_busy() -> None:
    """Found by review: with promotions' reads keeping more DRAM slots busy than the copies'
    share (1/8 of the pool, at least 16), the budget went negative and ``items[:budget]``
    posted all but the last few copies: 60 of 64 slots busy, none evictable for grants."""
    cache, disk, tier = disk_host(num_blocks=64, disk_slots=1024)
    keys = [f"k{i}" for i in range(64)]
    store_keys(cache, keys)
    now = 1.0
    while len(disk.keys) < 64 or disk.writing:
        assert now < 1000.0, "64 keys not copied to disk in 1000 steps"
        tier.step(now=now)
        now += 1.0
    tier.admit_after = 1000  # nothing admitted: no copy before the promotions below
    store_keys(cache, [f"n{i}" for i in range(64)])  # every k* leaves DRAM for the disk
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


def test_a_look_for_copies_that_found_none_is_repeated_once_the_window_moved_not_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: with the pool full and its least recently used keys on disk already or
    not admitted (seen once: most keys, with the default ``--disk-admit 2``), every step looked
    over the whole window again (8192 keys at the default grant size: 3 ms) every
    ``COPY_PERIOD_S`` (2 ms), so a busy host's loop spent most of its time there. A look that
    found nothing is now repeated once as many keys as half the window were evicted or used
    (new keys in it), or after ``COPY_IDLE_PERIOD_S`` (a key there seen again)."""
    cache, disk, tier = disk_host(num_blocks=64, disk_slots=1024, admit=2)
    store_keys(cache, [f"k{i}" for i in range(64)])  # seen once each: none admitted
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
    store_keys(cache, [f"n{i}" for i in range(window // 4)])  # as many evicted, and seen
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
        store_keys(cache, [f"k{j}" for j in range(i, i + 8)])
        for _ in range(3):
            tier.step(now=now)
            now += COPY_PERIOD_S
        lost += events_of(cache)[1]
    assert lost == [] and len(disk.keys) == 160


def test_copies_to_a_failing_disk_back_off_bounded_and_resume_once_one_is_done() -> None:
    """Found by review: a disk whose every write failed (EIO, full) was written again at every
    look for copies (every ``COPY_PERIOD_S``: 3200 blocks failed in 200 loop turns where 80 do
    now). Copies that all failed are now looked for again after a backoff that doubles up to
    ``COPY_BACKOFF_MAX_S``; a copy done ends it."""
    cache, disk, tier = disk_host()
    store_keys(cache, [f"k{i}" for i in range(8)])
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
        store_keys(cache, ["n0"])  # k0 leaves DRAM, on disk
        tier.step(now + 0.002)  # the next look is not backed off
        assert write.call_count == posted + 2
