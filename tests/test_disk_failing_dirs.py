"""A disk whose writes fail in part (found by review): one ``--disk`` directory of several dead
or read-only. The directories that still take writes keep taking copies, the failing one loses
no key it holds, and a write done there ends its failing."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from disk_support import HungDevice, digest_of, open_store, settle

from torch_kv_tier.remote import disk_index
from torch_kv_tier.remote.disk_io import DiskTransfers
from torch_kv_tier.remote.disk_store import DiskCompletions, DiskStore


def _fail(monkeypatch: pytest.MonkeyPatch, fails: Callable[[str, int], bool]) -> None:
    """Requests of ``kind`` to directory ``f`` fail to start where ``fails(kind, f)``."""
    real_post = DiskTransfers.post

    def post(self: DiskTransfers, kind: str, f: int, dram: list[int], disk: list[int]) -> Any:
        if fails(kind, f):
            self._failed(kind, f, f"a {kind} of {len(dram)} blocks could not start: injected EIO")
            return None, "ERR"
        return real_post(self, kind, f, dram, disk)

    monkeypatch.setattr(DiskTransfers, "post", post)


def _settled(store: DiskStore) -> DiskCompletions:
    """Every completion of the I/O posted."""
    done = settle(store)
    more = store.poll()  # those refused at once come with the next poll
    done.written += more.written
    done.read += more.read
    done.failed += more.failed
    return done


def _copy(store: DiskStore, pool: np.ndarray, keys: list[bytes], first: int) -> DiskCompletions:
    """Write ``keys`` from DRAM slots ``first``... and collect every completion."""
    store.write([("ns", k, digest_of(pool, first + i, k), first + i) for i, k in enumerate(keys)])
    return _settled(store)


def _keys_of(store: DiskStore, f: int) -> set[Any]:
    """The keys directory ``f`` of two holds."""
    return {pair for pair in store.slot_owners().pairs[f::2] if pair is not None}


def test_one_failing_directory_of_two_stops_no_copy_to_the_other(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write to directory a failed (a dead device): its free slots were the only ones a
    write could take while the last write failed, so every copy went to a and failed, and b,
    healthy, took none again (0 of 80 copies). b now takes the copies, evicting its own keys;
    a's keys are kept, and a is probed; one write done there ends its failing."""
    monkeypatch.setattr(disk_index, "WRITE_PROBE_S", 0.0)  # a probe at every write
    dirs = [tmp_path / "a", tmp_path / "b"]
    with closing(open_store(disk_pool, dirs, 4)) as store:
        store.recover()
        assert len(_copy(store, disk_pool, [f"k{i}".encode() for i in range(8)], 0).written) == 8
        a_dead = True
        _fail(monkeypatch, lambda kind, f: kind == "write" and a_dead and f == 0)
        for r in range(2):  # 8 keys evicted: a write to a (which LRU keys are a's varies)
            _copy(store, disk_pool, [f"f{r}-{i}".encode() for i in range(4)], 8)
        assert store.stats()["disk_writes_failing"] == 1
        held_in_a = _keys_of(store, 0)
        written = []
        for r in range(20):
            done = _copy(store, disk_pool, [f"n{r}-{i}".encode() for i in range(4)], 8 + r)
            written += done.written
        assert len(written) >= 50 and store.stats()["disk_writes_failing"] == 1
        assert _keys_of(store, 0) == held_in_a  # none evicted for writes that failed
        a_dead = False
        done = _copy(store, disk_pool, [b"healed"], 40)
        assert ("ns", b"healed") in done.written and store.stats()["disk_writes_failing"] == 0
        done = _copy(store, disk_pool, [f"m{i}".encode() for i in range(8)], 41)
        assert len(done.written) == 8 and len(_keys_of(store, 0)) == 4  # a written again


def test_a_request_stuck_in_one_directory_of_two_stops_no_copy_to_the_other(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: one request given up (a hung device, a stuck NFS mount) made the host
    refuse every write, to every directory, until it ended. Only its directory takes none now,
    counted failing: the other takes the copies, evicting its own keys, never the stuck one's,
    and once the stuck request ends, its directory is failing until a probe there is done."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    with closing(open_store(disk_pool, dirs, 8)) as store:
        store.recover()
        assert len(_copy(store, disk_pool, [b"A", b"B"], 0).written) == 2  # a's slot 0, b's 0
        hung = HungDevice(store, monkeypatch)
        store.request_timeout_s = 0.2  # this request's deadline only
        store.write([("ns", b"K", digest_of(disk_pool, 2, b"K"), 2)])  # a's slot 1: hangs
        store.request_timeout_s = 30.0
        deadline = time.monotonic() + 10.0
        while not store.stats()["disk_stuck_in_flight"] and time.monotonic() < deadline:
            store.poll()
        assert store.stats()["disk_stuck_in_flight"] == 1
        assert store.stats()["disk_writes_failing"] == 1
        hung.hangs = False
        keys = [f"n{i}".encode() for i in range(9)]
        items = [("ns", k, digest_of(disk_pool, 3 + i, k), 3 + i) for i, k in enumerate(keys)]
        assert store.write(items) == [("ns", b"B")]  # b's 7 free slots, then its key B
        assert sorted(k for _, k in settle(store).written) == keys[:8]
        assert _keys_of(store, 1) == {("ns", k) for k in keys[:8]}
        assert _keys_of(store, 0) == {("ns", b"A")}  # kept, and read once a answers again
        hung.resume()
        while store.stats()["disk_stuck_in_flight"] and time.monotonic() < deadline:
            store.poll()
        assert store.stats()["disk_stuck_in_flight"] == 0
        assert store.stats()["disk_writes_failing"] == 1  # until a probe there is done


def _index(dirs: int, per_dir: int) -> disk_index.DiskIndex:
    """An index over ``dirs`` directories of ``per_dir`` slots whose journals take anything."""
    fake = [SimpleNamespace(slots=per_dir, append=lambda *record: None) for _ in range(dirs)]
    return disk_index.DiskIndex(fake, dirs * per_dir)  # type: ignore[arg-type]


def test_a_failing_directory_with_many_free_slots_delays_no_copy_nor_its_probe() -> None:
    """Directory a failing with its 4096 free slots first in line, b full: the free slots were
    set aside 64 per write, and none was taken meanwhile, so b took no copy, nor a a probe, for
    the first 64 writes (16 K writes, over half a minute of copies, at 1 M slots); with every
    directory failing on a fresh disk, no probe either until every slot was set aside."""
    per_dir = 4096
    index = _index(2, per_dir)
    index.where.update({("ns", i): (2 * i + 1, 0) for i in range(per_dir)})  # b full
    index.slots.reset([slot for slot, _ in index.where.values()])  # a's slots free again
    index.wrote(0, False, now=0.0)
    evicted: list[Any] = []
    assert index.take_slot(evicted, 0.0) == 1 and evicted == [("ns", 0)]  # b's LRU key
    probe = index.take_slot(evicted, disk_index.WRITE_PROBE_S + 1)
    assert probe is not None and probe % 2 == 0  # a's probe, once due
    both = _index(2, per_dir)
    both.wrote(0, False, now=0.0)
    both.wrote(1, False, now=0.0)
    assert both.take_slot(evicted, 0.0) is None  # no probe due yet
    probes = [both.take_slot(evicted, disk_index.WRITE_PROBE_S + 1) for _ in range(3)]
    assert sorted(p % 2 for p in probes if p is not None) == [0, 1]  # one each, at once


def test_an_eviction_passes_over_a_failing_directorys_keys_once() -> None:
    """a failing, its keys the least recently used: every write's eviction walked all of them
    (0.5 s per key written at 1 M keys); they now go to the LRU's end as they are passed."""
    index = _index(2, 1024)
    index.where.update({("ns", i): (2 * i, 0) for i in range(1024)})  # a's, least recent
    index.where.update({("ns", -i - 1): (2 * i + 1, 0) for i in range(1024)})
    index.slots.reset([slot for slot, _ in index.where.values()])
    index.wrote(0, False, now=0.0)
    evicted: list[Any] = []
    assert index.take_slot(evicted, 0.0) == 1 and evicted == [("ns", -1)]
    assert next(iter(index.where)) == ("ns", -2)  # b's next: no key of a walked again
    assert sum(slot % 2 == 0 for slot, _ in index.where.values()) == 1024  # a's all kept


@pytest.mark.parametrize("seed", range(4))
def test_every_key_read_has_its_own_bytes_through_failing_healing_eviction_and_restarts(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """A seeded run of writes (keys stored again with other bytes once gone), removals, reads,
    directories turning dead or read-only and healing, and restarts over three directories of 3
    slots: every key read or recovered has the bytes last written for it (a key evicted,
    removed or failed is gone until written again), and once every directory heals, the whole
    capacity takes new keys with no eviction (no slot lost) in distinct slots."""
    monkeypatch.setattr(disk_index, "WRITE_PROBE_S", 0.0)
    rng = np.random.default_rng(seed)
    dirs = [tmp_path / d for d in "abc"]
    dead: dict[int, str] = {}  # directory -> "dead" (every request fails) or "read-only"
    _fail(monkeypatch, lambda kind, f: dead.get(f) == "dead" or (kind == "write" and f in dead))
    truth: dict[bytes, int | None] = {}  # key -> DRAM row of its bytes; None: not on disk

    def check(store: DiskStore) -> None:
        for (_, key), (_, digest) in store._index.where.items():
            row = truth.get(key)
            assert row is not None and digest == digest_of(disk_pool, row, key), key

    store = open_store(disk_pool, dirs, 3)
    try:
        store.recover()
        for _ in range(150):
            op = rng.integers(0, 10)
            if op < 4:  # write a few keys not on disk, each from a source row 0..31
                keys = {f"k{rng.integers(0, 16)}".encode() for _ in range(rng.integers(1, 4))}
                rows = {k: int(rng.integers(0, 32)) for k in keys if not store.contains("ns", k)}
                items = [("ns", k, digest_of(disk_pool, r, k), r) for k, r in rows.items()]
                for _, key in store.write(items):
                    truth[key] = None
                done = _settled(store)
                for _, key in done.written:
                    truth[key] = rows[key]
                for _, key, _ in done.failed:
                    assert not store.contains("ns", key)
            elif op < 6 and truth:  # read some keys back into rows 32..63
                keys = sorted(truth)[: rng.integers(1, 5)]
                store.read([("ns", k, 32 + i) for i, k in enumerate(keys)])
                done = _settled(store)
                for _, key, dram, _ in done.read:
                    row = truth[key]
                    assert row is not None and (disk_pool[dram] == disk_pool[row]).all(), key
                for _, key, _ in done.failed:
                    if not store.contains("ns", key):
                        truth[key] = None
            elif op < 7 and truth:
                key = sorted(truth)[rng.integers(0, len(truth))]
                store.remove("ns", key)
                truth[key] = None
            elif op < 9:  # a directory dies, turns read-only, or heals
                f = int(rng.integers(0, 3))
                state = ("dead", "read-only", None)[rng.integers(0, 3)]
                if state is None:
                    dead.pop(f, None)
                else:
                    dead[f] = state
            else:  # a clean restart, the failing state as it was
                store.close()
                store = open_store(disk_pool, dirs, 3)
                store.recover()
            check(store)
        dead.clear()
        for f in range(3):  # a done write (a probe) in each directory heals it
            for key in list(store._index.where):
                store.remove(*key)
            _copy(store, disk_pool, [f"heal{f}-{i}".encode() for i in range(3)], 0)
        assert store.stats()["disk_writes_failing"] == 0
        for key in list(store._index.where):
            store.remove(*key)
        keys = [f"fill{i}".encode() for i in range(9)]
        evicted = store.write(
            [("ns", k, digest_of(disk_pool, i, k), i) for i, k in enumerate(keys)]
        )
        assert evicted == [] and len(_settled(store).written) == 9
        assert len({slot for slot, _ in store._index.where.values()}) == 9
    finally:
        store.close()
