"""A disk directory's crash consistency, failure by failure (found by review): a header cut or
corrupted, a start refused for want of space, a journal write cut short or refused, a compaction
cut short, renamed without its directory synced or refused, blocks never synced before the
journal records naming them, a key evicted without a record saying so."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import stat
import threading
import time
import types
import weakref
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import (
    DISK_BLOCK,
    SETTLE_TIMEOUT_S,
    HungDevice,
    digest_of,
    make_disk_pool,
    open_store,
    poll_until,
    run_script,
    settle,
)

from torch_kv_tier.keys import Key
from torch_kv_tier.remote import (
    disk_files,
    disk_frames,
    disk_index,
    disk_journal,
    disk_store,
    disk_sync,
)
from torch_kv_tier.remote.disk_frames import DEL, PUT
from torch_kv_tier.remote.disk_io import DiskTransfers
from torch_kv_tier.remote.disk_journal import DiskDir
from torch_kv_tier.remote.disk_store import DiskCompletions, DiskError, DiskStore


def _write(store: DiskStore, disk_pool: np.ndarray, key: Key, dram: int) -> DiskCompletions:
    store.write([("ns", key, digest_of(disk_pool, dram, key), dram)])
    done = DiskCompletions()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while store.in_flight() or not (done.written or done.failed):  # refused: the next poll's
        assert time.monotonic() < deadline, f"the write of {key!r} neither done nor failed"
        more = store.poll()
        done.written += more.written
        done.failed += more.failed
    return done


def _records(n: int) -> list[Any]:
    return [(PUT, i, "ns", f"key-{i}".encode(), i) for i in range(n)]


@pytest.mark.parametrize(
    "text",
    ["", '{"format": 1, "block_', "[]", "null", '{"format": 1, "block_len": 16384, "slotr": 8}'],
)
def test_a_header_cut_or_corrupted_is_refused_with_what_to_do(tmp_path: Path, text: str) -> None:
    """A SIGKILL while ``meta.json`` was written left it empty or cut: the start raised a
    ``JSONDecodeError`` (or ``AttributeError``), a traceback instead of exit 1 with a message.
    A bit flipped in a field's name was refused as "holds None blocks of None bytes": pass the
    options it was made with (which were the ones passed)."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "meta.json").write_text(text)
    with pytest.raises(DiskError, match=f"{d}.*meta.json"):
        DiskDir(d, 8 * DISK_BLOCK, DISK_BLOCK)


def test_a_header_of_a_later_format_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """A directory made by a later torch-kv-tier (a downgrade in place) is not reinterpreted."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "meta.json").write_text('{"format": 4, "block_len": 16384, "slots": 8}')
    with pytest.raises(DiskError, match="names format 4, not 3: use the torch-kv-tier that made"):
        DiskDir(d, 8 * DISK_BLOCK, DISK_BLOCK)


@pytest.mark.parametrize("flip", [('"format": 3', '"format": 0'), ('"slots": 8', '"slots": 9')])
def test_a_header_value_flipped_says_it_is_damaged_and_removing_it_keeps_the_blocks(
    disk_pool: np.ndarray, tmp_path: Path, flip: tuple[str, str]
) -> None:
    """Found by review: a byte flipped in ``meta.json``'s values (24 of its 368 one-bit flips,
    the other 344 are no JSON or no header) was refused as "holds 8 blocks of 16384 bytes, not 8
    of 16384: pass the --block-len and --disk-bytes it was made with", which the operator had.
    No flip served a key or crashed: recovery checks every block against its digest. The
    message now says the header may be damaged, and what to do; doing it keeps the blocks."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        assert _write(store, disk_pool, b"k", 3).written
    meta = d / "meta.json"
    meta.write_text(meta.read_text().replace(*flip))
    with pytest.raises(DiskError, match=f"{meta} is damaged: restore it, or remove it"):
        open_store(disk_pool, [d], 8)
    meta.unlink()
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert store.recover() == [("ns", b"k", digest_of(disk_pool, 3, b"k"))]


def test_a_start_refused_for_want_of_space_leaves_the_directory_usable(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """The header was written before the block file was allocated: a start with a
    ``--disk-bytes`` beyond the free space told the operator to pass a smaller one, and the
    next start with a smaller one was refused as "a directory made with another size"."""
    with pytest.raises(DiskError, match="pass a smaller --disk-bytes"):
        open_store(disk_pool, [tmp_path / "d"], 1 << 44)
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:  # as the message said
        store.recover()


def test_a_journal_write_cut_short_costs_no_other_record(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short write then ENOSPC (a full file system) left a torn frame in the middle of the
    journal: every record appended after it, written past it, was ignored by the next start."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        d = store._dirs[0]
        assert (
            _write(store, disk_pool, b"k0", 0).written
            and _write(store, disk_pool, b"k1", 1).written
        )
        assert store.sync(10.0)
        calls: list[int] = []

        def full(fd: int, data: Any) -> int:
            if fd != d.journal:
                return real_write(fd, data)
            calls.append(fd)
            if len(calls) == 1:
                return real_write(fd, bytes(data)[:7])  # a short write...
            raise OSError(errno.ENOSPC, "No space left on device")  # ...then a full disk

        real_write = os.write
        monkeypatch.setattr(os, "write", full)
        assert _write(store, disk_pool, b"k2", 2).written  # its record: logged, not raised
        assert store.sync(10.0)  # the journals' thread: its writes done
        assert len(calls) == 3  # the rest of its record, then the header of the journal emptied
        monkeypatch.undo()
        assert _write(store, disk_pool, b"k3", 3).written
        assert store.sync(10.0)
        kept = {key for _, _, _, key, _ in d.read_records()}  # what a crash now would find
        assert {b"k0", b"k1", b"k3"} <= kept


def _journal_of_four_keys(disk_pool: np.ndarray, d: Path, *, remove_k: bool) -> Path:
    """A directory whose journal holds ``PUT`` records of K, X, Y and Z (blocks of DRAM slots 0
    to 3), then, with ``remove_k``, K's ``DEL`` (K committed again with other bytes)."""
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        for i, key in enumerate([b"K", b"X", b"Y", b"Z"]):
            assert _write(store, disk_pool, key, i).written
        assert not remove_k or store.remove("ns", b"K")
    return d / "journal.log"


def _frame_starts(journal: Path) -> list[int]:
    """The byte where each frame of ``journal`` starts (a whole journal: its header first)."""
    data, starts = journal.read_bytes(), [0]
    while starts[-1] < len(data):
        length = int.from_bytes(data[starts[-1] : starts[-1] + 4], "little")
        starts.append(starts[-1] + 8 + length)
    return starts[:-1]


@pytest.mark.parametrize("cut", ["in its payload", "in its header"])
def test_a_journal_cut_at_its_tail_says_how_many_records_it_kept_and_that_nothing_is_to_do(
    disk_pool: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: str
) -> None:
    """Found by review: a journal cut by a crash said "torn at byte 78: rest ignored", not what
    it cost; one cut in its last frame's header said nothing. Now: the record cut, the records
    kept, and that there is nothing to do."""
    journal = _journal_of_four_keys(disk_pool, tmp_path / "d", remove_k=False)
    z_at = _frame_starts(journal)[-1]  # Z's frame, the last: 5 bytes of it kept, or 3 cut
    kept = 5 if cut == "in its header" else journal.stat().st_size - z_at - 3
    os.truncate(journal, z_at + kept)
    with (
        caplog.at_level(logging.WARNING, logger=disk_journal.__name__),
        closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store,
    ):
        assert sorted(k for _, k, _ in store.recover()) == [b"K", b"X", b"Y"]
    said = [r.getMessage() for r in caplog.records if r.name == disk_journal.__name__]
    assert said == [
        f"disk: journal of {tmp_path / 'd'} cut at byte {z_at} of {z_at + kept} (a crash or power "
        "loss in the middle of an append): the record cut is lost (which key it named cannot be "
        "known: a miss if it stored one, back with the bytes it had if it removed one), the 3 "
        "before it are kept; nothing to do"
    ]


@pytest.mark.parametrize("damage", ["a byte flipped", "a page lost (zeros)"])
def test_a_journal_damaged_in_the_middle_serves_no_key_it_may_have_removed_and_says_the_cost(
    disk_pool: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Found by review: a journal damaged in X's record (of K, X, Y, Z, then K's removal, as a
    commit of K with other bytes does) was read up to the damage only: K came back with the
    bytes it no longer names, which verify, and Y and Z were dropped unsaid ("torn at byte 26:
    rest ignored", 0 dropped). The lost record may be such a removal: now no record of the
    journal is used, and the message says what that cost and what to check."""
    d = tmp_path / "d"
    journal = _journal_of_four_keys(disk_pool, d, remove_k=True)
    x_at, y_at = _frame_starts(journal)[2:4]  # after the header and K's
    data = bytearray(journal.read_bytes())
    if damage == "a byte flipped":
        data[x_at + 10] ^= 0x40
    else:
        data[x_at:y_at] = bytes(y_at - x_at)
    journal.write_bytes(data)
    with (
        caplog.at_level(logging.WARNING, logger=disk_journal.__name__),
        closing(open_store(disk_pool, [d], 8)) as store,
    ):
        assert store.recover() == []
        assert store.stats()["disk_recover_dropped"] == 2  # Y and Z
    said = [r.getMessage() for r in caplog.records if r.name == disk_journal.__name__]
    assert said == [
        f"disk: journal of {d} damaged at byte {x_at} of {len(data)}: 1 records before it and 3 "
        "after it still read, but the record lost may have removed a key whose old block still "
        "verifies, so none is used: the 2 keys they name, and the lost record's, are misses (this "
        f"start rewrites the journal); if this recurs, check the device of {d} (bad sectors, a "
        "failing disk)"
    ]
    with closing(open_store(disk_pool, [d], 8)) as store:  # rewritten: read whole, empty
        assert store.recover() == []
    assert len(_frame_starts(journal)) == 1  # its header only


def test_records_past_damage_are_found_within_a_bounded_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What tells damage from a crash's cut (``disk_frames.parse``): frames that read past a bad
    one, found across unreadable bytes (zeros cost nothing) up to ``RESYNC_BYTES`` of them; past
    that, the rest counts as unsearched (damage), never as a cut with nothing after it."""
    first, last = (PUT, 0, "ns", b"k0", 1), (DEL, 0, "ns", b"k0", 0)
    junk = bytes(range(1, 65)) + bytes(4096)  # not zero, then a page of zeros
    parsed = disk_frames.parse(disk_frames.frames([first]) + junk + disk_frames.frames([last]))
    assert parsed.records == [first] and parsed.after == [last] and parsed.searched_all
    monkeypatch.setattr(disk_frames, "RESYNC_BYTES", 32)
    parsed = disk_frames.parse(disk_frames.frames([first]) + junk + disk_frames.frames([last]))
    assert parsed.bad_at == len(disk_frames.frames([first])) and not parsed.searched_all


def test_a_compaction_cut_short_or_refused_keeps_every_live_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rewrite`` wrote the temporary journal with one ``os.write``: a short write replaced the
    journal by a cut one (keys lost at the next start); an ENOSPC raised out of it (out of
    ``DiskStore.poll``: the host's loop died)."""
    d = DiskDir(tmp_path / "d", 8 * DISK_BLOCK, DISK_BLOCK)
    try:
        live = _records(50)
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:100]))
        d.rewrite(live)
        monkeypatch.undo()
        assert d.read_records() == live

        def full(fd: int, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", full)
        assert not d.rewrite(_records(10))  # logged, not raised; the journal stays as it was
        monkeypatch.undo()
        assert d.stale and d.read_records() == live
        assert not (tmp_path / "d" / "journal.tmp").exists()
    finally:
        d.close()


def test_a_journal_emptied_for_a_dropped_record_says_when_a_restart_finds_its_blocks_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal emptied because a record could not be written logs that a restart before its
    rewrite finds none of its blocks; the rewrite that ended that said nothing, so an operator
    could not tell when a restart was safe again. It now logs a line naming the directory."""
    d = DiskDir(tmp_path / "d", 8 * DISK_BLOCK, DISK_BLOCK)
    try:
        live = _records(3)
        assert d.rewrite(live)

        def full(fd: int, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        with caplog.at_level(logging.INFO, logger=disk_journal.__name__):
            monkeypatch.setattr(os, "write", full)
            d.append(PUT, 3, "ns", b"key-3", 3)
            d.flush(*d.take_pending(), sync=True)
            monkeypatch.undo()
            assert d.stale and d.read_records() == [] and "emptied" in caplog.text
            caplog.clear()
            assert d.rewrite(live)  # no longer stale: no line
            assert d.rewrite(live) and d.read_records() == live
        (line,) = [r.getMessage() for r in caplog.records]
        assert str(tmp_path / "d") in line and "a restart finds its blocks again" in line
    finally:
        d.close()


def test_a_compaction_syncs_the_directory_after_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename of the compacted journal was never made durable (no fsync of the directory):
    after a power loss the old journal could come back, without every record appended to the
    new one since, however long ago they were synced."""
    d = DiskDir(tmp_path / "d", 8 * DISK_BLOCK, DISK_BLOCK)
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(a: Any, b: Any) -> None:
        events.append("rename")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    try:
        d.rewrite(_records(3))
        assert "rename" in events and "fsync dir" in events[events.index("rename") :]
    finally:
        monkeypatch.undo()
        d.close()


@pytest.mark.parametrize("journal", ["appended", "rewritten"])
def test_blocks_are_synced_before_the_journal_records_naming_them(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: str
) -> None:
    """The block file was never synced, the journal once a second: after a power loss a
    record could outlive its block (dropped by the digest, but more lost than the README's
    "the last second of journal records"). Rewritten (found by the second review): a
    compaction, or the rewrite of a stale journal, synced a journal naming every live key
    without syncing the blocks written since the last period first."""
    store = open_store(disk_pool, [tmp_path / "d"], 8)
    synced: list[int] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd))[1])
    try:
        store.recover()
        d = store._dirs[0]
        assert _write(store, disk_pool, b"k", 0).written
        assert store._journals.wait(5.0)  # a sync of the journals' thread: done
        synced.clear()
        if journal == "appended":
            assert store.sync(10.0)
        else:
            d.rewrite(store._index.live_records(0))
        assert d.fd in synced and d.journal in synced
        assert synced.index(d.fd) < synced.index(d.journal)
    finally:
        monkeypatch.undo()
        store.close()


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
        assert _write(store, disk_pool, b"churn", 9).written
        store.remove("ns", b"churn")
    store._index._turn = 0
    assert _write(store, disk_pool, b"K", 0).written  # old content, a's slot 0
    for i, key in enumerate([b"x1", b"x2", b"x3"]):
        assert _write(store, disk_pool, key, 1 + i).written
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
    assert _write(store, disk_pool, b"K", 6).written  # K stored again: new content, in b
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
        assert _write(store, disk_pool, b"K", 0).written
        assert _write(store, disk_pool, b"other", 1).written
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
        assert _write(store, disk_pool, b"k0", 0).written
        assert _write(store, disk_pool, b"k1", 1).written
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
            assert _write(store, disk_pool, f"k{i}".encode(), i).written
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
        assert _write(store, disk_pool, b"k0", 0).written
    (tmp_path / "d" / "journal.log").unlink()
    with caplog.at_level(logging.WARNING):
        with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
            assert store.recover() == []
        with closing(open_store(disk_pool, [tmp_path / "fresh"], 8)) as store:  # not a new one
            store.recover()
    said = [r.getMessage() for r in caplog.records if "no journal.log" in r.getMessage()]
    assert said == [
        f"disk: {tmp_path / 'd'} has no journal.log (deleted or moved away): the "
        "blocks it held are forgotten, misses; restore it before starting to keep them"
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
        assert _write(s, disk_pool, b"k0", 0).written
        assert s.sync(5.0) and not said()
        shutil.rmtree(tmp_path / "d")
        assert _write(s, disk_pool, b"k1", 1).written  # to the deleted file
        assert s.sync(5.0)
        assert _write(s, disk_pool, b"k2", 2).written
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
                assert _write(store, disk_pool, f"f{i}".encode(), i).failed
            monkeypatch.setattr(agent, "transfer", real_transfer)
            assert _write(store, disk_pool, b"ok", 5).written
            monkeypatch.setattr(agent, "transfer", backend_error)
            assert _write(store, disk_pool, b"f9", 6).failed
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
        assert _write(store, disk_pool, b"k0", 0).written
        keys = [f"k{i}".encode() for i in range(1, 8)]
        store.write([("ns", k, digest_of(disk_pool, i, k), i) for i, k in enumerate(keys, 1)])
        assert len(settle(store).written) == 7 and len(store) == 8  # the disk is full
        agent = store._io._agent
        real_transfer = agent.transfer

        def eio(handle: Any) -> str:
            raise RuntimeError("injected: EIO")

        monkeypatch.setattr(agent, "transfer", eio)
        assert _write(store, disk_pool, b"n0", 8).failed  # not known to fail: k0 evicted
        assert store.stats()["disk_writes_failing"] == 1 and len(store) == 7
        items = [(f"n{i}".encode(), 8 + i) for i in range(1, 5)]
        assert store.write([("ns", k, digest_of(disk_pool, s, k), s) for k, s in items]) == []
        assert len(store.poll().failed) == 1  # into k0's slot alone
        assert len(store) == 7 and store.stats()["disk_evictions"] == 1
        monkeypatch.setattr(agent, "transfer", real_transfer)
        assert _write(store, disk_pool, b"n1", 9).written  # into the free slot
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
        assert _write(store, disk_pool, b"k0", 0).written
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
        assert _write(store, disk_pool, b"k0", 0).written
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
        assert _write(store, disk_pool, b"k0", 0).written
        for _ in range(5000):  # records of a slot never written: the journal is due a compaction
            d.append(DEL, 7, "ns", b"gone", 0)
        assert store.sync(10.0) and d.records > 4 * len(store) + 4096
        monkeypatch.setattr(os, "write", no_room_for_a_new_journal)
        with caplog.at_level(logging.WARNING, logger=disk_journal.__name__):
            store.poll()  # the compaction is built and handed over: its journal.tmp refused
            assert store._journals.wait(10.0) and "not compacted" in caplog.text
        assert not d.stale and d.retry_at > 0.0  # tried again later, not at every poll
        assert _write(store, disk_pool, b"k1", 1).written  # journaled in the old journal
        assert store.sync(10.0) and not d.stale
        kept = {key for _, _, _, key, _ in d.read_records()}  # what a crash now would find
        assert {b"k0", b"k1"} <= kept
        monkeypatch.undo()  # room again: the compaction, tried again at retry_at, fits
        d.retry_at = 0.0
        store.poll()
        assert store._journals.wait(10.0) and d.records == 2
    with closing(open_store(disk_pool, [path], 8)) as store:
        assert sorted(k for _, k, _ in store.recover()) == [b"k0", b"k1"]


def test_a_write_stuck_on_a_hung_device_is_given_up_and_its_late_bytes_land_nowhere(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk request that hung (a stuck device, NFS) was waited on forever: its key stayed
    "being written" (never copied again) and its DRAM slot unevictable, for good. It is now
    given up after ``request_timeout_s``: the key fails, its DRAM slot is free, its disk slot
    stays taken and the disk takes no write until the request ends, so the late write (of
    whatever the DRAM slot then holds) overwrites no other key's block."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    with closing(open_store(disk_pool, dirs, 8)) as store:
        store.recover()
        hung = HungDevice(store, monkeypatch)
        store.request_timeout_s = 0.2  # this request's deadline only: others get 30 s
        store.write([("ns", b"K", digest_of(disk_pool, 0, b"K"), 0)])  # a's slot 0
        store.request_timeout_s = 30.0
        assert poll_until(store, "failed")["failed"] == [("ns", b"K", 0)]
        assert not store.contains("ns", b"K")
        assert store.busy_dram_slots() == set() and store.in_flight() == 0
        assert store.stats()["disk_stuck"] == 1
        hung.hangs = False
        disk_pool[0] = 7  # the DRAM slot now holds another key
        keys = [f"L{i}".encode() for i in range(6)]
        items = [("ns", k, digest_of(disk_pool, 1 + i, k), 1 + i) for i, k in enumerate(keys)]
        assert store.write(items) == [] and store.in_flight() == 1  # to b: a is stuck
        hung.resume()  # the stuck write lands now
        deadline = time.monotonic() + 10.0
        while store.stats()["disk_stuck_in_flight"] and time.monotonic() < deadline:
            store.poll()
            time.sleep(0.01)
        assert store.stats()["disk_stuck_in_flight"] == 0
        store.write(items)
        assert not settle(store).failed and all(store.contains("ns", k) for k in keys)
        store.read([("ns", k, 32 + i) for i, k in enumerate(keys)])
        assert len(settle(store).read) == len(keys)
        assert np.array_equal(disk_pool[32:38], disk_pool[1:7])
    with closing(open_store(disk_pool, dirs, 8)) as store:
        assert sorted(k for _, k, _ in store.recover()) == keys  # every block verifies


def test_a_read_stuck_on_a_hung_device_is_given_up_and_keeps_its_dram_slot_until_it_ends(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk read that hung was waited on forever (the promotion never failed). It is now
    given up after ``request_timeout_s``: the read is reported ``abandoned``, its DRAM slot
    kept busy (the read may still write it) until it ends; a read of its directory meanwhile
    fails at once. Found by the disk review: that refused read also dropped its key, intact on
    disk, for good; it now keeps it, read once the directory answers (as the key of the read
    given up does: ``test_disk_hung_reads``)."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        assert _write(store, disk_pool, b"K", 0).written
        assert _write(store, disk_pool, b"M", 1).written
        hung = HungDevice(store, monkeypatch)
        store.request_timeout_s = 0.2  # this request's deadline only
        store.read([("ns", b"K", 30)])
        store.request_timeout_s = 30.0
        got = poll_until(store, "abandoned")
        assert got["abandoned"] == [("ns", b"K", 30)] and not got["read"] and not got["failed"]
        assert store.busy_dram_slots() == {30}
        store.read([("ns", b"M", 31)])  # the directory is stuck: refused, never posted
        assert store.poll().failed == [("ns", b"M", 31)] and store.contains("ns", b"M")
        assert store.busy_dram_slots() == {30} and len(hung.held) == 1
        hung.resume()
        assert poll_until(store, "released")["released"] == [30]
        assert store.busy_dram_slots() == set()
        assert np.array_equal(disk_pool[30], disk_pool[0])  # what landed late, where it was kept
        hung.hangs = False
        assert store.read([("ns", b"M", 31)]) == []  # the directory answers: M is read
        assert [(k, d) for _, k, d, _ in settle(store).read] == [(b"M", 31)]
        assert np.array_equal(disk_pool[31], disk_pool[1])


def test_settle_fails_with_a_message_on_a_request_that_never_ends(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the tests' ``settle`` polled until no request was in flight, with no
    timeout of its own, so a request that never ended (a hung device, under a long
    ``request_timeout_s``) hung the test run until CI's limit. It now fails, saying so."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        store.recover()
        hung = HungDevice(store, monkeypatch)
        store.request_timeout_s = 3600.0  # never given up by the store
        store.write([("ns", b"K", digest_of(disk_pool, 0, b"K"), 0)])
        with pytest.raises(AssertionError, match="1 disk requests still in flight after 0 s"):
            settle(store, timeout=0.2)
        hung.resume()  # it ends: nothing left for close to wait on
        assert settle(store).written == [("ns", b"K")]


def test_a_request_in_flight_at_close_keeps_the_memory_and_files_it_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the second review: a request still in flight ``CLOSE_WAIT_S`` after ``close``
    began (a hung device) had its NIXL handle released, the pool and files deregistered and
    closed, and the server then freed the pool: once the device answered, the read wrote into
    freed memory (a crash, or another object's bytes overwritten), in a handle NIXL had freed.
    What it uses is now kept until the process exits, and the log says so."""
    monkeypatch.setattr(disk_store, "CLOSE_WAIT_S", 0.2)
    pool = make_disk_pool()
    owner = weakref.ref(pool)
    store = open_store(pool, [tmp_path / "d"], 8)
    store.recover()
    assert _write(store, pool, b"K", 0).written
    hung = HungDevice(store, monkeypatch)
    store.read([("ns", b"K", 30)])
    agent = store._io._agent
    released: list[Any] = []
    monkeypatch.setattr(agent, "release_xfer_handle", released.append)
    monkeypatch.setattr(agent, "deregister_memory", lambda *a, **k: released.append(a))
    with caplog.at_level(logging.ERROR, logger=disk_store.__name__):
        store.close()
    assert released == []
    assert "1 requests still in flight" in caplog.text and str(tmp_path / "d") in caplog.text
    monkeypatch.setattr(disk_files, "LOCK_WAIT_S", 0.1)
    with pytest.raises(DiskError, match="is in use"):  # its block file still open
        open_store(make_disk_pool(), [tmp_path / "d"], 8)
    expected = pool[0].copy()
    del pool
    gc.collect()
    assert owner() is not None  # the pool is not freed under the read
    (handle,) = hung.held
    hung.resume()  # the device answers: the read lands late, in the pool kept
    deadline = time.monotonic() + 10.0
    while agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.01)
    kept = owner()
    assert kept is not None and np.array_equal(kept[30], expected)


def test_a_read_that_fails_as_the_store_closes_keeps_its_key_for_a_restart(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the third review: on io_uring the kernel cancels a request whose posting thread
    exits, so an embedder that runs ``Server.serve`` on a thread and ``close`` on another had
    the loop's promotion reads still in flight fail as ``close`` collected them, and each failed
    read dropped its key from the journal: a good block lost to the restart. A read that fails
    once closing began keeps its key (a restart verifies every block anyway)."""
    dirs = [tmp_path / "d"]
    store = open_store(disk_pool, dirs, 8)
    store.recover()
    assert _write(store, disk_pool, b"K", 0).written
    HungDevice(store, monkeypatch)
    store.read([("ns", b"K", 30)])
    monkeypatch.setattr(store._io, "state", lambda handle, kind, f: "ERR")  # cancelled
    store.close()
    with closing(open_store(disk_pool, dirs, 8)) as again:
        assert [key for _, key, _ in again.recover()] == [b"K"]


_KEPT_AT_EXIT = """
import sys
from pathlib import Path
from disk_support import digest_of, make_disk_pool, open_store, settle
from torch_kv_tier.remote import disk_store

class Pool:
    def __init__(self):
        self.rows = make_disk_pool()
    def __del__(self):
        print("pool freed", flush=True)

disk_store.CLOSE_WAIT_S = 0.2
pool = Pool()
store = open_store(pool.rows, [Path(sys.argv[1])], 8)
store._pool_owner = pool
store.recover()
store.write([("ns", b"K", digest_of(pool.rows, 0, b"K"), 0)])
settle(store)
store.read([("ns", b"K", 3)])
store._io.state = lambda handle, kind, f: "PROC"  # the device stops answering
store.close()
del pool, store
print("exiting", flush=True)
"""


def test_what_a_request_in_flight_at_close_uses_outlives_interpreter_shutdown(
    tmp_path: Path,
) -> None:
    """Found by the third review: what ``close`` kept for a request still in flight (the pool
    it may write, the NIXL agent, the files) sat in a module-level list, which interpreter
    shutdown clears: the process freed the pool while NIXL still counted the request in flight,
    before the agent that could cancel it went (a tuple drops its items last first). It is now
    never released (its reference count raised once more), as ``agent_lifetime`` keeps unsafe
    agents, and the process still exits cleanly."""
    proc = run_script(_KEPT_AT_EXIT, tmp_path / "d")
    assert "1 requests still in flight" in proc.stderr
    assert "exiting" in proc.stdout and "pool freed" not in proc.stdout


def test_a_journal_sync_that_hangs_at_close_leaves_its_files_open(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The journals' thread (``disk_sync``) still in an fsync when ``close`` gave up on it: its
    files are kept open under it (never closed, their descriptors never reused), and the log
    says so; ``close`` still returns."""
    monkeypatch.setattr(disk_store, "CLOSE_WAIT_S", 0.2)
    store = open_store(disk_pool, [tmp_path / "d"], 8)
    store.recover()
    answers = threading.Event()
    real_fsync = os.fsync

    def hung(fd: int) -> None:
        answers.wait(30.0)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", hung)
    try:
        with caplog.at_level(logging.ERROR, logger=disk_store.__name__):
            store.close()
        assert "journals not synced" in caplog.text
        monkeypatch.setattr(disk_files, "LOCK_WAIT_S", 0.1)
        with pytest.raises(DiskError, match="is in use"):  # its block file still open
            open_store(disk_pool, [tmp_path / "d"], 8)
    finally:
        answers.set()


def test_a_disk_request_the_device_cannot_answer_at_once_never_blocks_its_poster(
    tmp_path: Path,
) -> None:
    """Found by the second review: NIXL's POSIX backend ran on Linux AIO, whose ``io_submit``
    does buffered I/O (tmpfs, a ``--block-len`` not a multiple of 4 KiB, a file system that
    refuses O_DIRECT) in the caller, and waits there for a device that stopped answering (or a
    full request queue): the host's loop thread, which posts and polls every disk request,
    froze with it, and the request timeout never ran. The backend runs on io_uring where the
    kernel has it, which hands such I/O to its own workers. Stand-in for the device: a FIFO,
    whose read ends only once it is written."""
    os.mkfifo(tmp_path / "fifo")
    fd = os.open(tmp_path / "fifo", os.O_RDWR)
    pool = make_disk_pool()
    block = 4096  # a pipe's writes of at most this many bytes land whole: no short read
    io = DiskTransfers(
        [(fd, 4, "fifo")],
        block_len=block,
        pool_addr=pool.ctypes.data,
        pool_blocks=4,
        name="fifo-test",
    )
    posted: list[str] = []

    def post_and_poll() -> None:  # as the host's loop: the thread that posts it polls it
        handle, state = io.post("read", 0, [0], [0])
        posted.append(state)
        deadline = time.monotonic() + 20.0
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = io.state(handle, "read", 0)
        posted.append(state)
        io.release(handle)

    poster = threading.Thread(target=post_and_poll, daemon=True)
    try:
        poster.start()
        deadline = time.monotonic() + 5.0
        while not posted and time.monotonic() < deadline:
            time.sleep(0.01)
        returned = bool(posted)
        os.write(fd, bytes(range(256)) * (block // 256))  # the read can end now
        poster.join(25.0)
        assert returned, "posting a read the device cannot answer at once blocked its caller"
        assert posted[-1] == "DONE" and bytes(pool[0][:4]) == bytes([0, 1, 2, 3])
    finally:
        io.close()
        os.close(fd)


def test_a_kernel_without_io_uring_still_gets_a_disk_tier(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where io_uring is refused (an old kernel, a container's seccomp profile) the backend
    falls back to Linux AIO, logged, and blocks round-trip as before."""
    from nixl._api import nixl_agent

    real = nixl_agent.create_backend

    def no_uring(self: Any, backend: str, params: dict[str, str]) -> Any:
        if params.get("use_uring"):
            raise RuntimeError("injected: io_uring_queue_init: Operation not permitted")
        return real(self, backend, params)

    monkeypatch.setattr(nixl_agent, "create_backend", no_uring)
    with caplog.at_level(logging.WARNING, logger="torch_kv_tier.remote.disk_io"):
        store = open_store(disk_pool, [tmp_path / "d"], 8)
    try:
        assert "no io_uring" in caplog.text and "Linux AIO instead" in caplog.text
        store.recover()
        assert _write(store, disk_pool, b"k", 0).written
        store.read([("ns", b"k", 40)])
        assert len(settle(store).read) == 1 and np.array_equal(disk_pool[40], disk_pool[0])
    finally:
        store.close()
