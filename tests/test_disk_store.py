"""``DiskStore`` on real files through NIXL's POSIX backend: blocks round-trip byte-identical,
the disk's LRU never evicts a block with I/O in flight, a restart finds (and verifies) what was
written, damage costs exactly the damaged keys, bad directories are refused with what to do,
and closing releases every file."""

from __future__ import annotations

import errno
import json
import os
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import DISK_BLOCK, HungDevice, digest_of, open_store, poll_until, settle
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_kv_tier.keys import Key
from torch_kv_tier.remote import disk_files, disk_sync
from torch_kv_tier.remote.disk_slots import DiskSlots
from torch_kv_tier.remote.disk_store import DiskError, DiskStore


def _write(store: DiskStore, disk_pool: np.ndarray, items: list[tuple[str, Key, int]]) -> Any:
    evicted = store.write([(ns, k, digest_of(disk_pool, s, k), s) for ns, k, s in items])
    return evicted, settle(store)


def test_blocks_round_trip_byte_identical_across_two_directories(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    with closing(open_store(disk_pool, [tmp_path / "a", tmp_path / "b"], 128)) as store:
        assert store.recover() == []
        keys: list[Key] = [b"bytes-key", "str-key", 7, *[f"k{i}".encode() for i in range(29)]]
        evicted, done = _write(store, disk_pool, [("m1", k, i) for i, k in enumerate(keys)])
        assert evicted == [] and sorted(map(str, done.written)) == sorted(
            str(("m1", k)) for k in keys
        )
        assert store.contains("m1", 7) and not store.contains("m2", 7)
        assert not store.contains("m1", "7") and not store.contains("m1", b"str-key")
        assert store.read([("m1", k, 32 + i) for i, k in enumerate(keys)]) == []
        done = settle(store)
        assert len(done.read) == len(keys) and not done.failed
        assert np.array_equal(disk_pool[32:64], disk_pool[:32])
        assert all(d == store.digest(ns, k) for ns, k, _, d in done.read)
        assert store.read([("m2", 7, 0)]) == [("m2", 7)]  # another namespace: not on disk
        assert sorted(os.listdir(tmp_path / "a")) == ["blocks.dat", "journal.log", "meta.json"]


def test_a_pool_not_page_aligned_gets_buffered_files_not_failed_copies(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """Found by the third review: a store over a pool not page-aligned said ``direct_io`` False
    but still opened its block files O_DIRECT, whose transfers need aligned buffers: every copy
    failed (a warning each, no key ever on disk). Such a pool now gets buffered files (where
    the file system takes O_DIRECT, as ext4 and xfs do, this failed before)."""
    raw = np.empty(disk_pool.nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096 + 8
    pool = raw[start : start + disk_pool.nbytes].reshape(disk_pool.shape)
    pool[:] = disk_pool
    with closing(open_store(pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        assert not store.direct_io
        _, done = _write(store, pool, [("ns", b"K", 0)])
        assert done.written == [("ns", b"K")] and not done.failed
        store.read([("ns", b"K", 40)])
        assert len(settle(store).read) == 1 and np.array_equal(pool[40], pool[0])


def test_the_disk_evicts_its_least_recently_used_never_a_block_in_flight(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    with closing(open_store(disk_pool, [tmp_path / "d"], 4)) as store:
        store.recover()
        _write(store, disk_pool, [("n", f"old{i}", i) for i in range(4)])
        store.read([("n", "old0", 10)])  # in flight: old0 stays, and is the most recent
        assert store.busy_dram_slots() == {10}
        evicted = store.write([("n", "new0", digest_of(disk_pool, 5, "new0"), 5)])
        assert evicted == [("n", "old1")]
        assert store.busy_dram_slots() == {10, 5}
        settle(store)
        evicted, _ = _write(store, disk_pool, [("n", f"new{i}", 5 + i) for i in range(1, 4)])
        assert sorted(evicted) == [("n", "old0"), ("n", "old2"), ("n", "old3")]
        assert store.stats()["disk_evictions"] == 4 and len(store) == 4


def test_a_block_removed_while_it_is_read_keeps_its_slot_until_the_read_ends(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """Found by review: ``remove`` freed the disk slot at once, so a write could take it while
    a read of it was still in flight. Found by the second review: that read still ended as a
    read, and a promotion published the removed copy (removed because its key was stored again
    with other bytes): once the new copy left DRAM, the old bytes, which verify, were a hit.
    It now fails."""
    with closing(open_store(disk_pool, [tmp_path / "a"], 128)) as store:
        store.recover()
        _write(store, disk_pool, [("ns", b"old", 0)])
        (slot, _) = store._index.where[("ns", b"old")]
        assert store.read([("ns", b"old", 40)]) == []  # in flight until polled
        assert store.remove("ns", b"old")
        store.write([("ns", b"new", digest_of(disk_pool, 1, b"new"), 1)])
        done = settle(store)
        assert done.read == [] and done.failed == [("ns", b"old", 40)]
        assert store._index.where[("ns", b"new")][0] != slot
        store.write([("ns", b"newer", digest_of(disk_pool, 2, b"newer"), 2)])
        settle(store)
        assert store._index.where[("ns", b"newer")][0] == slot  # free once the read ended


def test_a_block_read_twice_at_once_keeps_its_slot_until_both_reads_end(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the fifth disk review: a slot was marked busy once however many requests used
    it, so the first of two reads of one block to end (or a read of it refused while the
    directory hung) unmarked it: the block removed, a write took its slot while the other
    read still read it. The slot is now free only once every request using it ended."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        _write(store, disk_pool, [("ns", b"K", 0)])
        (slot, _) = store._index.where[("ns", b"K")]
        hung = HungDevice(store, monkeypatch)
        assert store.read([("ns", b"K", 30)]) == [] and store.read([("ns", b"K", 31)]) == []
        assert hung.real_transfer(hung.held.pop(0)) != "ERR"  # the first read ends, not the other
        assert poll_until(store, "read")["read"][0][:3] == ("ns", b"K", 30)
        assert store.remove("ns", b"K")
        hung.hangs = False  # writes land; the second read is still in flight
        store.write([("ns", b"M", digest_of(disk_pool, 1, b"M"), 1)])
        assert poll_until(store, "written")["written"] == [("ns", b"M")]
        assert store._index.where[("ns", b"M")][0] != slot  # not where the read still reads
        hung.resume()
        assert settle(store).failed == [("ns", b"K", 31)]  # its copy removed: never a hit
        _write(store, disk_pool, [("ns", b"N", 2)])
        assert store._index.where[("ns", b"N")][0] == slot  # free once both reads ended


def test_a_restart_recovers_every_key_and_damage_costs_only_the_damaged(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    items = [("ns", f"k{i}".encode(), i) for i in range(40)]
    with closing(open_store(disk_pool, dirs, 128)) as store:
        store.recover()
        _write(store, disk_pool, items)
        store.remove("ns", b"k39")
    with closing(open_store(disk_pool, dirs, 128)) as store:
        found = store.recover()
        assert sorted(k for _, k, _ in found) == sorted(k for _, k, _ in items[:39])
        assert all(d == digest_of(disk_pool, int(k[1:]), k) for _, k, d in found)  # type: ignore[arg-type]
    with open(tmp_path / "a" / "blocks.dat", "r+b") as fh:  # k0 lives in a's slot 0
        fh.write(b"\xff" * 100)
    journal = tmp_path / "b" / "journal.log"
    os.truncate(journal, journal.stat().st_size - 3)  # b's last record torn
    with closing(open_store(disk_pool, dirs, 128)) as store:
        found = store.recover()
        assert len(found) == 37 and b"k0" not in {k for _, k, _ in found}
        assert store.stats()["disk_recover_dropped"] == 1
        _write(
            store, disk_pool, [("ns", b"again", 50)]
        )  # new keys take free slots, never a kept one
        assert len(store) == 38


def test_a_block_file_truncated_while_running_fails_reads_never_crashes(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    with closing(open_store(disk_pool, [tmp_path / "d"], 128)) as store:
        store.recover()
        _write(store, disk_pool, [("ns", f"k{i}", i) for i in range(8)])
        os.truncate(tmp_path / "d" / "blocks.dat", 0)
        disk_pool[32:40] = 0
        store.read([("ns", f"k{i}", 32 + i) for i in range(8)])
        done = settle(store)
        for _, key, slot, digest in done.read:  # whatever came back fails its digest
            assert digest_of(disk_pool, slot, key) != digest
        assert len(done.read) + len(done.failed) == 8


def test_a_directory_made_for_other_blocks_is_refused(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    open_store(disk_pool, [tmp_path / "d"], 128).close()
    with pytest.raises(DiskError, match="--block-len and --disk-bytes it was made with"):
        open_store(disk_pool, [tmp_path / "d"], 64)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta == {"format": 3, "block_len": DISK_BLOCK, "slots": 128, "generation": 0}


def test_a_directory_in_use_is_refused_with_what_to_do(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: two stores on one directory (a second host started on it, or
    ``--disk`` naming it twice as ``d`` and ``x/../d``) shared its block file and journal,
    each writing over the other's blocks: keys lost, misses where hits were due."""
    monkeypatch.setattr(disk_files, "LOCK_WAIT_S", 0.2)
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)):
        with pytest.raises(DiskError, match=f"{tmp_path / 'd'} is in use by this process"):
            open_store(disk_pool, [tmp_path / "d"], 8)
        with pytest.raises(DiskError, match="in use by this process.*naming it twice"):
            open_store(disk_pool, [tmp_path / "e", tmp_path / "d" / ".." / "e"], 8)
    open_store(disk_pool, [tmp_path / "d"], 8).close()  # free again once closed


def test_an_unusable_path_and_a_full_file_system_are_refused(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DiskError, match=str(blocker / "sub")):
        open_store(disk_pool, [blocker / "sub"], 128)
    with pytest.raises(DiskError, match="only [0-9]+ free: pass a smaller --disk-bytes"):
        open_store(disk_pool, [tmp_path / "huge"], 1 << 44)
    with pytest.raises(ValueError, match="holds no block"):
        DiskStore([str(tmp_path)], 100, block_len=DISK_BLOCK, pool_addr=0, pool_blocks=1)


def test_closing_releases_every_file(disk_pool: np.ndarray, tmp_path: Path) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    open_store(disk_pool, [tmp_path / "d"], 128).close()  # NIXL's first use opens files it keeps
    before = open_fds()
    for _ in range(10):
        store = open_store(disk_pool, [tmp_path / "d"], 128)
        store.recover()
        _write(store, disk_pool, [("ns", b"k", 0)])
        store.close()
        store.close()  # idempotent
    assert open_fds() == before


@pytest.mark.parametrize("error", [errno.EOPNOTSUPP, errno.EINVAL])
def test_a_file_system_without_fallocate_is_used_with_a_sparse_block_file(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Found by the second review: a file system that cannot allocate in advance (NFSv3, some
    FUSE mounts: glibc's fallback writes single bytes, which an O_DIRECT file refuses with
    EINVAL) stopped the host at start, told to "pass a smaller --disk-bytes or free space"
    with plenty free. The block file is now sized without reserving its space (logged): a disk
    that fills up later fails copies, a miss."""

    def no_fallocate(fd: int, offset: int, size: int) -> None:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    store = open_store(disk_pool, [tmp_path / "d"], 8)
    try:
        store.recover()
        assert (tmp_path / "d" / "blocks.dat").stat().st_size == 8 * DISK_BLOCK
        _write(store, disk_pool, [("ns", b"k", 0)])
        store.read([("ns", b"k", 40)])
        assert len(settle(store).read) == 1 and np.array_equal(disk_pool[40], disk_pool[0])
    finally:
        store.close()


def _replayed(store: DiskStore) -> set[tuple[int, str, Key, int]]:
    """What a restart would find in the journals once synced: (global slot, namespace, key,
    digest)."""
    assert store.sync(10.0)
    n = len(store._dirs)
    return {
        (j * n + f, ns, key, digest)
        for f, d in enumerate(store._dirs)
        for j, (_, ns, key, digest) in d.live().items()
    }


def _indexed(store: DiskStore) -> set[tuple[int, str, Key, int]]:
    return {(slot, ns, key, digest) for (ns, key), (slot, digest) in store._index.where.items()}


def test_a_compaction_builds_a_bounded_part_of_its_records_per_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the compaction review: a compaction, or the rewrite of a stale journal, built
    every live record of its directory in one ``poll`` on the host's loop thread (2.2 s per
    million keys with two directories), so at millions of keys the host answered no handshake
    nor heartbeat for seconds and every tier dropped it. Each ``poll`` now builds at most
    ``COMPACT_SLOTS`` slots' records; the journal rewritten still names exactly the index."""
    block, keys = 512, 200_000
    raw = np.zeros(64 * block + 4096, dtype=np.uint8)
    pool = raw[-raw.ctypes.data % 4096 :][: 64 * block].reshape(64, block)
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = DiskStore(
        dirs, keys // 2 * block, block_len=block, pool_addr=pool.ctypes.data, pool_blocks=64
    )
    with closing(store):
        store.recover()
        for start in range(0, keys, 8192):
            store.write([("ns", i, i, i % 64) for i in range(start, min(keys, start + 8192))])
            assert not settle(store).failed
        assert len(store) == keys and store._journals.wait(10.0)
        real, built = store._index.live_records, []  # records built by each call

        def count(*args: Any) -> Any:
            built.append(len(records := real(*args)))
            return records

        monkeypatch.setattr(store._index, "live_records", count)
        for d in store._dirs:
            d.stale, d.retry_at = True, 0.0  # a write failed: rewritten from the index
        most = polls = 0
        while any(d.stale for d in store._dirs) and polls < 10_000:
            built.clear()
            store.poll()
            most, polls = max(most, sum(built)), polls + 1
            assert store._journals.wait(10.0)
        assert not any(d.stale for d in store._dirs)
        assert 0 < most <= keys // 16  # not every key of a directory in one loop turn
        assert _replayed(store) == _indexed(store)


def test_keys_changed_while_a_compaction_is_built_are_journaled_as_they_end(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction built one slot per poll: keys written, evicted, read and removed between
    those polls (slots the build read before and after each change) end in the rewritten
    journal as in the index, and a restart loads every key's own bytes."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    with closing(open_store(disk_pool, dirs, 16)) as store:
        store.recover()
        _write(store, disk_pool, [("n", f"k{i}", i) for i in range(30)])
        assert store._journals.wait(10.0)
        for d in store._dirs:
            d.stale, d.retry_at = True, 0.0
        step = 0
        while step == 0 or store.compacting():
            assert step < 40  # 16 slots a directory, one a step
            monkeypatch.setattr(disk_sync, "COMPACT_SLOTS", 1)
            store.poll()  # the build one slot further (the first: it begins too)
            assert store._journals.wait(10.0)
            monkeypatch.setattr(disk_sync, "COMPACT_SLOTS", 0)  # none while keys change
            i = 30 + step
            _write(store, disk_pool, [("n", f"k{i}", i % 60)])  # evicts the LRU once full
            store.remove("n", f"k{step * 7 % i}")
            store.read([("n", f"k{i - 3}", 63)])
            settle(store)
            step += 1
        assert store._journals.wait(10.0)
        assert step == 32 and not any(d.stale for d in store._dirs)
        assert _replayed(store) == _indexed(store)
        kept = {(ns, k): digest for (ns, k), (_, digest) in store._index.where.items()}
    with closing(open_store(disk_pool, dirs, 16)) as store:
        found = store.recover()
        assert {(ns, k): digest for ns, k, digest in found} == kept
        assert store._counters["disk_recover_dropped"] == 0


@settings(deadline=None)  # its 200 ms default fails a loaded machine's slow example
@given(
    st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, 24 * n - 1))))
)
def test_a_restart_hands_out_the_slots_recovery_left_free_lowest_first_then_fresh_ones(
    dirs_held: tuple[int, set[int]],
) -> None:
    """``DiskSlots.reset`` (numpy since a restart at 4 M slots spent most of a second in a
    Python set): every slot of a directory below the highest one held and not held is handed
    out, lowest first, then the never used ones, never a held one, then none."""
    n, held = dirs_held
    slots = DiskSlots(24 * n, n)
    slots.reset(sorted(held, reverse=True))
    for f in range(n):
        free = [slot for slot in range(f, 24 * n, n) if slot not in held]
        assert [slots.take(f) for _ in free] == free
        assert slots.take(f) is None
