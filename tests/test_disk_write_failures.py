"""What a disk directory's keys become when its writes fail (found by review): a key evicted for
a write that failed, or removed while its journal cannot be written (a full disk), never comes
back stale; a block or journal unreadable at recovery, a journal deleted or a directory
removed between runs, writes failing on and on, a rewrite or compaction refused for want of
space: each costs what it must, said once, with what to do."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import types
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import (
    digest_of,
    open_store,
    settle,
    write_key,
)

from torch_kv_tier.remote import (
    disk_index,
    disk_journal,
    disk_sync,
)
from torch_kv_tier.remote.disk_frames import DEL, PUT
from torch_kv_tier.remote.disk_store import DiskError, DiskStore


def _evict_k_for_a_failed_write_then_store_it_in_b(
    store: DiskStore,
    disk_pool: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
    before_write: Callable[[], None] | None,
) -> None:
    """Key K (old content) in directory a's slot 0, a's journal the longer; a write of L evicts
    K and fails to start (``before_write`` runs just before it); then K is stored again, with
    new content, in directory b."""
    store.recover()
    for _ in range(6):  # a's journal grows longer than b's (writes take directories in turn)
        store._index._turn = 0
        assert write_key(store, disk_pool, b"churn", 9).written
        store.remove("ns", b"churn")
    store._index._turn = 0
    assert write_key(store, disk_pool, b"K", 0).written  # old content, a's slot 0
    for i, key in enumerate([b"x1", b"x2", b"x3"]):
        assert write_key(store, disk_pool, key, 1 + i).written
    assert store._index.where[("ns", b"K")][0] == 0
    real_transfer = store._io._agent.transfer

    def refused(handle: Any) -> str:
        raise RuntimeError("injected: the write could not start")

    if before_write is not None:
        before_write()
    monkeypatch.setattr(store._io._agent, "transfer", refused)
    store.write([("ns", b"L", digest_of(disk_pool, 5, b"L"), 5)])  # evicts K; fails
    assert store.poll().failed == [("ns", b"L", 5)] and not store.contains("ns", b"K")
    monkeypatch.setattr(store._io._agent, "transfer", real_transfer)
    store.remove("ns", b"x1")  # b's slot 0 free
    assert write_key(store, disk_pool, b"K", 6).written  # K stored again: new content, in b
    assert store._index.where[("ns", b"K")][0] == 1


@pytest.mark.parametrize("a_journal", ["written", "full, then a crash"])
def test_a_key_evicted_for_a_write_that_failed_does_not_come_back_stale(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, a_journal: str
) -> None:
    """Key K, evicted from directory a for a write that failed, stored again in b: at the next
    start the old copy came back over the new one. Written: the eviction wrote no ``DEL``, so
    a's record still named K. Full, then a crash: a's ``DEL`` was lost, and recovery compared
    the journal positions of two directories as if one order, so the deeper copy won (a key
    found in two directories is now dropped)."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    real_write = os.write

    def a_full(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(dirs[0])):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    full = a_journal != "written"
    with closing(open_store(disk_pool, dirs, 2)) as store:  # global slots 0, 2 in a; 1, 3 in b
        before_write = (lambda: monkeypatch.setattr(os, "write", a_full)) if full else None
        _evict_k_for_a_failed_write_then_store_it_in_b(store, disk_pool, monkeypatch, before_write)
        # every record appended handed to the journals' thread and done: a poll that found it
        # busy left K's DEL in memory, handed over at a later poll (wait() alone missed it)
        assert store.sync(10.0)
        assert store._dirs[0].stale == full  # full: K's DEL lost
        if full:
            monkeypatch.setattr(store, "_sync_journals", lambda force: None)  # SIGKILL
    monkeypatch.undo()
    with closing(open_store(disk_pool, dirs, 2)) as store:
        store.recover()
        assert store.digest("ns", b"K") in (None, digest_of(disk_pool, 6, b"K"))


@pytest.mark.parametrize("end", ["a clean stop", "a crash"])
def test_a_key_removed_while_its_journal_cannot_be_written_does_not_come_back(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """Key K's copy removed (as a commit of K with other bytes does) while the journal's file
    system is full: its ``DEL`` was dropped with the stale journal, which still named K, so the
    next start served K's old bytes, which verify, as a hit, after a crash or even a clean stop
    (its last rewrite failed too). A journal that drops a record is now emptied: the next start
    finds none of that directory's keys (misses) unless a rewrite succeeded meanwhile."""
    path = tmp_path / "d"
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    with closing(open_store(disk_pool, [path], 8)) as store:
        store.recover()
        assert write_key(store, disk_pool, b"K", 0).written
        assert write_key(store, disk_pool, b"other", 1).written
        assert store.sync(10.0)
        monkeypatch.setattr(os, "write", full)
        assert store.remove("ns", b"K")
        assert store.sync(10.0) and store._dirs[0].stale  # its DEL: not written
        if end == "a crash":
            monkeypatch.setattr(store, "_sync_journals", lambda force: None)
    monkeypatch.undo()
    with closing(open_store(disk_pool, [path], 8)) as store:
        store.recover()
        assert not store.contains("ns", b"K")


def test_a_block_unreadable_at_recovery_costs_its_key_not_the_start(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EIO reading one block (a bad sector) raised out of ``recover``: the host refused to
    start ("[Errno 5] Input/output error", no path), at every restart."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        assert write_key(store, disk_pool, b"k0", 0).written
        assert write_key(store, disk_pool, b"k1", 1).written
        assert store._index.where[("ns", b"k0")][0] == 0
    real_preadv = os.preadv

    def bad_sector(fd: int, buffers: Any, offset: int) -> int:
        if offset == 0:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", bad_sector)
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        assert [k for _, k, _ in store.recover()] == [b"k1"]
        assert store.stats()["disk_recover_dropped"] == 1


def test_a_restart_says_which_directory_lost_how_many_blocks(
    disk_pool: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A byte flipped or ``blocks.dat`` truncated between runs cost those keys (misses) and
    said nothing: the only line was "N blocks recovered and verified", however many were lost."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    with closing(open_store(disk_pool, dirs, 8)) as store:
        store.recover()
        for i in range(4):  # round-robin: k0, k2 in a; k1, k3 in b
            assert write_key(store, disk_pool, f"k{i}".encode(), i).written
    with open(dirs[0] / "blocks.dat", "r+b") as blocks:  # k0's first byte
        first = blocks.read(1)
        blocks.seek(0)
        blocks.write(bytes([first[0] ^ 1]))
    with closing(open_store(disk_pool, dirs, 8)) as store, caplog.at_level(logging.WARNING):
        assert sorted(k for _, k, _ in store.recover()) == [b"k1", b"k2", b"k3"]
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(said) == 1 and f"1 of the 2 blocks the journal of {dirs[0]} names" in said[0]


def test_a_journal_deleted_between_runs_is_said_to_forget_its_blocks(
    disk_pool: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``journal.log`` deleted between runs forgot every block of its directory silently."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        assert write_key(store, disk_pool, b"k0", 0).written
    (tmp_path / "d" / "journal.log").unlink()
    with caplog.at_level(logging.WARNING):
        with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
            assert store.recover() == []
        with closing(open_store(disk_pool, [tmp_path / "fresh"], 8)) as store:  # not a new one
            store.recover()
    said = [r.getMessage() for r in caplog.records if "no journal.log" in r.getMessage()]
    assert said == [
        f"disk: {tmp_path / 'd'} has no journal.log (deleted or moved away; or removed by the "
        "last host, which logged it): the blocks it held are forgotten, misses; restore it "
        "before starting to keep them"
    ]


def test_a_directory_removed_under_a_running_store_is_said_once(
    disk_pool: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``rm -r`` of a disk directory under a running host said nothing (at most, after
    thousands of records, "not compacted"): it went on writing deleted files, and a restart
    found none of their blocks."""

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "removed or replaced" in r.getMessage()]

    with caplog.at_level(logging.ERROR), closing(open_store(disk_pool, [tmp_path / "d"], 8)) as s:
        s.recover()
        assert write_key(s, disk_pool, b"k0", 0).written
        assert s.sync(5.0) and not said()
        shutil.rmtree(tmp_path / "d")
        assert write_key(s, disk_pool, b"k1", 1).written  # to the deleted file
        assert s.sync(5.0)
        assert write_key(s, disk_pool, b"k2", 2).written
        assert s.sync(5.0)
    assert len(said()) == 1 and str(tmp_path / "d") in said()[0]


def test_writes_failing_on_and_on_are_logged_once_until_one_is_done(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A file system gone read-only under a host (an ext4 error) failed every copy, and each
    request logged "disk write failed: NIXL_ERR_BACKEND": 66 lines in 10 s, for as long as it
    ran, none saying what to check."""
    monkeypatch.setattr(disk_index, "WRITE_PROBE_S", 0.0)  # a write to a failing disk each time
    with closing(open_store(disk_pool, [tmp_path / "d"], 16)) as store:
        store.recover()
        agent = store._io._agent
        real_transfer = agent.transfer

        def backend_error(handle: Any) -> str:
            raise RuntimeError("NIXL_ERR_BACKEND")

        with caplog.at_level(logging.INFO, logger="torch_kv_tier.remote.disk_io"):
            monkeypatch.setattr(agent, "transfer", backend_error)
            for i in range(4):
                assert write_key(store, disk_pool, f"f{i}".encode(), i).failed
            monkeypatch.setattr(agent, "transfer", real_transfer)
            assert write_key(store, disk_pool, b"ok", 5).written
            monkeypatch.setattr(agent, "transfer", backend_error)
            assert write_key(store, disk_pool, b"f9", 6).failed
            monkeypatch.setattr(agent, "transfer", real_transfer)
    said = [  # (not NIXL's own lines: another test may have left its logger at INFO)
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.INFO and r.name == "torch_kv_tier.remote.disk_io"
    ]
    assert len(said) == 3, said
    assert "NIXL_ERR_BACKEND" in said[0] and f"check the file system of {tmp_path / 'd'}" in said[0]
    assert said[1] == f"disk writes in {tmp_path / 'd'} succeed again"
    assert "NIXL_ERR_BACKEND" in said[2]


def test_a_failing_disk_evicts_no_key_it_holds_for_writes_until_one_is_done(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: every write to a failing disk (EIO, read-only) evicted a key it held to
    make room, and freed the slot as it failed; a look for copies larger than the last one
    evicted more: good keys, readable, lost for copies that could never be written. While the
    last write failed, writes now take free slots only; one done ends that."""
    monkeypatch.setattr(disk_index, "WRITE_PROBE_S", 0.0)  # a write to a failing disk each time
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        assert write_key(store, disk_pool, b"k0", 0).written
        keys = [f"k{i}".encode() for i in range(1, 8)]
        store.write([("ns", k, digest_of(disk_pool, i, k), i) for i, k in enumerate(keys, 1)])
        assert len(settle(store).written) == 7 and len(store) == 8  # the disk is full
        agent = store._io._agent
        real_transfer = agent.transfer

        def eio(handle: Any) -> str:
            raise RuntimeError("injected: EIO")

        monkeypatch.setattr(agent, "transfer", eio)
        assert write_key(store, disk_pool, b"n0", 8).failed  # not known to fail: k0 evicted
        assert store.stats()["disk_writes_failing"] == 1 and len(store) == 7
        items = [(f"n{i}".encode(), 8 + i) for i in range(1, 5)]
        assert store.write([("ns", k, digest_of(disk_pool, s, k), s) for k, s in items]) == []
        assert len(store.poll().failed) == 1  # into k0's slot alone
        assert len(store) == 7 and store.stats()["disk_evictions"] == 1
        monkeypatch.setattr(agent, "transfer", real_transfer)
        assert write_key(store, disk_pool, b"n1", 9).written  # into the free slot
        assert store.stats()["disk_writes_failing"] == 0
        assert store.write([("ns", b"n2", digest_of(disk_pool, 10, b"n2"), 10)]) == [("ns", b"k1")]
        assert settle(store).written == [("ns", b"n2")]


def test_a_journal_unreadable_at_recovery_is_refused_with_what_to_do(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the third review: an EIO reading the journal (a bad sector) raised out of
    ``recover`` as it came (the host said "cannot start: [Errno 5] Input/output error" and the
    file, nothing of what to do). It is a ``DiskError`` that says."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        assert write_key(store, disk_pool, b"k0", 0).written
    real_read_bytes = Path.read_bytes

    def bad_sector(path: Path) -> bytes:
        if path.name == "journal.log":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", bad_sector)
    with (
        closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store,
        pytest.raises(DiskError, match="journal.log cannot be read .*: restore it, or move"),
    ):
        store.recover()


def test_a_journal_that_cannot_be_rewritten_is_retried_with_backoff(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale journal on a full disk is rewritten again 1 s, then 2, 4... s later (a rewrite
    encodes every live record), not at every loop turn; ``close`` tries once more. The journals'
    clock is frozen, moved on by the test: a stalled run neither makes a retry due early nor
    moves ``retry_at`` off the time the rewrite was tried."""
    clock = types.SimpleNamespace(now=1000.0)
    frozen = types.SimpleNamespace(monotonic=lambda: clock.now)
    monkeypatch.setattr(disk_journal, "time", frozen)
    monkeypatch.setattr(disk_sync, "time", frozen)
    store = open_store(disk_pool, [tmp_path / "d"], 8)
    tries: list[bool] = []
    try:
        store.recover()
        d = store._dirs[0]
        assert write_key(store, disk_pool, b"k0", 0).written
        real_rewrite, real_write = d.rewrite, os.write

        def full(fd: int, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(
            d, "rewrite", lambda *a, **kw: tries.append(real_rewrite(*a, **kw)) or True
        )
        monkeypatch.setattr(os, "write", full)
        d.append(PUT, 0, "ns", b"k0", 0)  # its flush fails: stale
        for _ in range(200):
            store.poll()
            assert store._journals.wait(5.0)  # the journals' thread: what it set, seen
        assert d.stale and tries == [False] and d.retry_at == 1001.0
        clock.now = 1000.999  # not yet due
        store.poll()
        assert store._journals.wait(5.0) and tries == [False]
        clock.now = 1001.0
        store.poll()
        assert store._journals.wait(5.0)
        assert tries == [False, False] and d.retry_at == 1003.0  # twice as late
        monkeypatch.setattr(os, "write", real_write)
    finally:
        store.close()  # tries once more, and succeeds
    assert tries == [False, False, True] and not d.stale


def test_a_compaction_refused_for_want_of_space_keeps_the_journal_a_restart_recovers(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the disk review: a compaction whose temporary journal did not fit (a nearly full
    disk) marked the journal stale, so the next record, which the old journal still took, was
    dropped and the journal emptied: a restart found none of its blocks until a compaction fit,
    up to ``REWRITE_RETRY_MAX_S`` apart. The old journal, whole, is now appended to as before,
    and the compaction tried again later (logged)."""
    path = tmp_path / "d"
    real_write = os.write

    def no_room_for_a_new_journal(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path / "journal.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    with closing(open_store(disk_pool, [path], 8)) as store:
        store.recover()
        d = store._dirs[0]
        assert write_key(store, disk_pool, b"k0", 0).written
        for _ in range(5000):  # records of a slot never written: the journal is due a compaction
            d.append(DEL, 7, "ns", b"gone", 0)
        assert store.sync(10.0) and d.records > 4 * len(store) + 4096
        monkeypatch.setattr(os, "write", no_room_for_a_new_journal)
        with caplog.at_level(logging.WARNING, logger=disk_journal.__name__):
            store.poll()  # the compaction is built and handed over: its journal.tmp refused
            assert store._journals.wait(10.0) and "not compacted" in caplog.text
        assert not d.stale and d.retry_at > 0.0  # tried again later, not at every poll
        assert write_key(store, disk_pool, b"k1", 1).written  # journaled in the old journal
        assert store.sync(10.0) and not d.stale
        kept = {key for _, _, _, key, _ in d.read_records()}  # what a crash now would find
        assert {b"k0", b"k1"} <= kept
        monkeypatch.undo()  # room again: the compaction, tried again at retry_at, fits
        d.retry_at = 0.0
        store.poll()
        assert store._journals.wait(10.0) and d.records == 2
    with closing(open_store(disk_pool, [path], 8)) as store:
        assert sorted(k for _, k, _ in store.recover()) == [b"k0", b"k1"]
