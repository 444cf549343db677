"""A journal whose file system duplicated some of its bytes (found by review: a page written
twice after a crash, landing on a record boundary): every frame still reads, and the copy
replayed an old ``PUT`` after the records that removed it. A key stored again since then came
back after a restart with the bytes of the store before, which verify against that store's
digest (the digest a load checks is the journal's): a hit on bytes the key no longer names.
Records now carry their order: one out of order is damage, dropped alone at the journal's end
(a cut tail), else the whole journal (its keys misses)."""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
from contextlib import closing, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import DISK_BLOCK, as_format, digest_of, open_store, settle

from torch_kv_tier.remote import disk_header, disk_journal, disk_replay
from torch_kv_tier.remote.disk_frames import PUT, parse, read_header
from torch_kv_tier.remote.disk_store import DiskStore


def _write(store: DiskStore, pool: np.ndarray, key: bytes, dram: int) -> None:
    store.write([("ns", key, digest_of(pool, dram, key), dram)])
    assert settle(store).written == [("ns", key)]


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the disk tier's journals logged (warnings, errors)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name in (disk_journal.__name__, disk_replay.__name__) and r.levelno >= logging.WARNING
    ]


def _frames(data: bytes, count: int) -> bytes:
    """The first ``count`` frames of ``data`` (a journal's bytes)."""
    end = 0
    for _ in range(count):
        end += 8 + struct.unpack_from("<I", data, end)[0]
    return data[:end]


@pytest.mark.parametrize("copied", [1, 2])  # records written again: a tail, then damage
def test_records_duplicated_by_the_file_system_never_bring_old_bytes_back(
    disk_pool: np.ndarray, tmp_path: Path, copied: int
) -> None:
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)  # slot 0: K's first bytes
        _write(store, disk_pool, b"J", 1)  # slot 1
        assert store.remove("ns", b"K") and store.remove("ns", b"J")  # both slots free
        _write(store, disk_pool, b"K", 2)  # K stored again with other bytes: slot 1
        assert store.digest("ns", b"K") == digest_of(disk_pool, 2, b"K")
    journal = d / "journal.log"
    data = journal.read_bytes()
    # the frames of K's first PUT, and of the records after it (past the journal's header),
    # written again at the journal's end
    journal.write_bytes(data + _frames(data, 1 + copied)[read_header(data)[0] :])
    with closing(open_store(disk_pool, [d], 8)) as store:
        found = {key: digest for _, key, digest in store.recover()}
        assert found.get(b"K", digest_of(disk_pool, 2, b"K")) == digest_of(disk_pool, 2, b"K")
        if b"K" in found:  # what a load of it returns
            store.read([("ns", b"K", 40)])
            assert len(settle(store).read) == 1
            assert np.array_equal(disk_pool[40], disk_pool[2])


@pytest.mark.parametrize("fmt", [1, 2])  # no record orders; no journal generation
@pytest.mark.parametrize("full_at_start", [False, True])
def test_a_directory_of_an_older_format_keeps_its_blocks_as_it_is_migrated(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    full_at_start: bool,
    fmt: int,
) -> None:
    """A host upgraded in place stopped at start, refusing its --disk directories (format 1,
    whose records carry no order), every block lost once moved away. Their journals are now
    read as format 1, rewritten as this format, and only then their headers: every key is
    kept, also where the rewrite at start fails (a full disk: migrated by the rewrite after).
    So is a directory of format 2, whose journal has no header naming its generation."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)
        _write(store, disk_pool, b"J", 1)
        assert store.remove("ns", b"J")
    as_format(d, fmt)
    want = [("ns", b"K", digest_of(disk_pool, 0, b"K"))]
    if full_at_start:
        with closing(open_store(disk_pool, [d], 8)) as store:

            def full(*args: object, **kwargs: object) -> int:
                raise OSError(errno.ENOSPC, "No space left on device")

            with monkeypatch.context() as m:
                m.setattr(disk_journal, "write_durably", full)
                assert store.recover() == want  # its journal stale: rewritten later
            assert json.loads((d / "meta.json").read_text())["format"] == fmt
            assert store.sync(5.0)  # the stale journal's rewrite
        assert json.loads((d / "meta.json").read_text())["format"] == disk_journal.FORMAT
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert store.recover() == want
        assert json.loads((d / "meta.json").read_text())["format"] == disk_journal.FORMAT
        _write(store, disk_pool, b"L", 2)
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert sorted(store.recover()) == sorted(
            [*want, ("ns", b"L", digest_of(disk_pool, 2, b"L"))]
        )


def _frame_of(data: bytes, op: int, slot: int, key: bytes) -> bytes:
    """The frame of ``data`` (a journal's bytes) holding the record ``op`` of ``key`` at
    ``slot``."""
    pos = 0
    while pos < len(data):
        end = pos + 8 + struct.unpack_from("<I", data, pos)[0]
        records = parse(data[pos:end]).records  # none: the journal's header
        if records and records[0][:2] == (op, slot) and records[0][3] == key:
            return data[pos:end]
        pos = end
    raise AssertionError(f"no record {op} of {key!r} at slot {slot}")


def _k_stored_again(store: DiskStore, pool: np.ndarray, d: Path) -> bytes:
    """Store K (slot 0: its first bytes, kept there once removed), then again with other bytes
    (slot 1), after records enough that K's first ``PUT`` is past a restart's first orders;
    returns the journal of ``d`` then, synced."""
    for _ in range(5):
        _write(store, pool, b"F", 3)
        assert store.remove("ns", b"F")
    _write(store, pool, b"K", 0)
    _write(store, pool, b"X", 1)
    assert store.remove("ns", b"K") and store.remove("ns", b"X")
    _write(store, pool, b"K", 2)
    assert store.sync(5.0)
    return (d / "journal.log").read_bytes()


@pytest.mark.parametrize("new_journal", ["compaction", "restart"])
def test_records_of_the_journal_before_a_rewrite_found_in_the_new_one_bring_no_old_bytes_back(
    disk_pool: np.ndarray, tmp_path: Path, new_journal: str
) -> None:
    """Found by review: a compaction numbered its records below the last ones of the journal
    it replaced, and a restart's rewrite numbered them from the same start as the run before,
    so an older journal's record found in the new one (a block of the file system written
    again) read in order, after the records that undid it: K came back with the bytes of its
    first store. Every journal's orders now follow those of the journal before."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 16)) as store:
        store.recover()
        old = _k_stored_again(store, disk_pool, d)
        if new_journal == "compaction":
            store._dirs[0].records = 1 << 20  # past 4x the live keys: compacted
            store.poll()
            assert store.sync(5.0) and store._dirs[0].records == 1
    if new_journal == "restart":  # the restart's rewrite: one record
        with closing(open_store(disk_pool, [d], 16)) as store:
            store.recover()
    journal = d / "journal.log"
    journal.write_bytes(journal.read_bytes() + _frame_of(old, PUT, 0, b"K"))
    with closing(open_store(disk_pool, [d], 16)) as store:
        assert store.recover() == [("ns", b"K", digest_of(disk_pool, 2, b"K"))]


@pytest.mark.parametrize("where", ["before the new journal", "instead of it"])
def test_records_of_an_older_journal_at_the_start_of_the_new_one_bring_no_old_bytes_back(
    disk_pool: np.ndarray, tmp_path: Path, where: str
) -> None:
    """Found by review: whole records of an older journal at the very start of a new journal
    file (a file system that returns a block of the old file after a crash, as ext4's
    data=writeback does for blocks allocated by appends not yet synced) read in order, there
    being no record before them: K, removed, came back after a restart with the bytes of its
    first store, which verify against its old digest, though the last bytes stored under K were
    other ones. Each journal now starts with a header naming its generation, which
    ``meta.json`` names too: one of an older journal is not used (its keys are misses)."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)  # slot 0: K's first bytes
        _write(store, disk_pool, b"J", 1)  # slot 1
        assert store.remove("ns", b"K") and store.remove("ns", b"J")  # slot 0 keeps K's bytes
        _write(store, disk_pool, b"K", 2)  # K stored again with other bytes (slot 1)...
        assert store.remove("ns", b"K")  # ...and removed: K names no block on disk
        assert store.sync(5.0)
        old = (d / "journal.log").read_bytes()
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert store.recover() == []  # a restart: its journal rewritten, no record of K
    journal = d / "journal.log"
    stale = _frames(old, 2)  # the old journal's header, then K's first PUT, at slot 0
    journal.write_bytes(
        stale + journal.read_bytes() if where == "before the new journal" else stale
    )
    with closing(open_store(disk_pool, [d], 8)) as store:
        found = store.recover()
        if found:  # what a load of K returns
            store.read([("ns", b"K", 40)])
            assert len(settle(store).read) == 1
            assert not np.array_equal(disk_pool[40], disk_pool[0]), "K's first bytes served"
        assert found == []


def test_a_header_refused_for_a_full_disk_leaves_the_journal_as_it_was_and_costs_no_key(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: each rewrite of a journal was followed by one of ``meta.json`` naming
    its new generation, so a crash between the two, or a ``meta.json`` refused for a full disk
    (written again only by the next rewrite), cost every key of that directory at the next
    start. ``meta.json`` is now written before the new journal's rename (a crash between the
    two: the next start completes the rename, ``test_disk_crash_points``), and a rewrite whose
    ``meta.json`` is refused is not done: the journal and ``meta.json`` stay as they were, and
    agree; the rewrite is tried again later."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)
    real = disk_header.write_durably

    def no_header(path: Path, *data: bytes | bytearray, **kwargs: Any) -> int:
        if path.name == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *data, **kwargs)

    with monkeypatch.context() as m, closing(open_store(disk_pool, [d], 8)) as store:
        m.setattr(disk_header, "write_durably", no_header)
        assert store.recover() == [("ns", b"K", digest_of(disk_pool, 0, b"K"))]
        assert store._dirs[0].stale  # its rewrite: not done, tried again later
        m.setattr(store, "_sync_journals", lambda force: None)  # a crash before then
    meta = json.loads((d / "meta.json").read_text())
    assert meta["generation"] == read_header((d / "journal.log").read_bytes())[1]
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger=disk_journal.__name__),
        closing(open_store(disk_pool, [d], 8)) as store,
    ):
        assert store.recover() == [("ns", b"K", digest_of(disk_pool, 0, b"K"))]
    assert not _said(caplog)


def test_records_of_a_journal_emptied_before_a_crash_bring_no_old_bytes_back_after_it(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: a journal emptied for a sync that failed (EIO), then a crash before its
    rewrite: the restart numbered its new journal from the generation ``meta.json`` names, below
    the orders of the emptied journal's records, so one of them that the file system returned in
    the new journal read in order: K came back with the bytes of its first store, though the
    last bytes stored under K were other ones. The emptied journal now keeps a header naming an
    order past its records, and a restart numbers past it (no error: that header alone is no
    older journal's record)."""
    d = tmp_path / "d"
    real_sync = os.fdatasync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(d)):
            raise OSError(errno.EIO, "Input/output error")
        real_sync(fd)

    with closing(open_store(disk_pool, [d], 16)) as store:
        store.recover()
        old = _k_stored_again(store, disk_pool, d)
        monkeypatch.setattr(os, "fdatasync", failing)
        assert store.remove("ns", b"K")
        assert store.sync(5.0) and store._dirs[0].stale  # emptied, not yet rewritten
        monkeypatch.setattr(store, "_sync_journals", lambda force: None)  # a crash: no rewrite
    monkeypatch.undo()
    caplog.clear()
    with (
        caplog.at_level(logging.ERROR, logger=disk_journal.__name__),
        closing(open_store(disk_pool, [d], 16)) as store,
    ):
        assert store.recover() == []
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    journal = d / "journal.log"
    journal.write_bytes(journal.read_bytes() + _frame_of(old, PUT, 0, b"K"))
    with closing(open_store(disk_pool, [d], 16)) as store:
        assert store.recover() == []


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_crash_between_a_migrations_journal_and_its_header_says_so_and_serves_nothing_old(
    disk_pool: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture, fmt: int
) -> None:
    """Found by review: a crash as a directory of format 1 or 2 was migrated (by a version
    that wrote ``meta.json`` after the journal), its journal rewritten as format 3 but its
    ``meta.json`` not yet, read that journal as one of the old
    format: an error said it was damaged and to check the device (format 2), or a warning that
    a record cut at its tail was lost and nothing was to do (format 1), though every key it
    named was a miss. It now says what happened, with the keys it cost; the start after is
    clean."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)
    meta = json.loads((d / "meta.json").read_text())
    del meta["generation"]
    (d / "meta.json").write_text(json.dumps({**meta, "format": fmt}))  # the journal's: not yet
    with (
        caplog.at_level(logging.WARNING, logger=disk_journal.__name__),
        closing(open_store(disk_pool, [d], 8)) as store,
    ):
        assert store.recover() == []
        assert store.stats()["disk_recover_dropped"] == 1
    (line,) = _said(caplog)
    assert f"meta.json names no header (disk format {fmt})" in line
    assert "a crash of a version that wrote meta.json after the journal, a migration's" in line
    assert "none of its 1 records is used: the 1 keys" in line
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger=disk_journal.__name__),
        closing(open_store(disk_pool, [d], 8)) as store,
    ):
        assert store.recover() == []
        _write(store, disk_pool, b"L", 1)
    assert not _said(caplog)
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert store.recover() == [("ns", b"L", digest_of(disk_pool, 1, b"L"))]


class _Crash(BaseException):
    """The host killed (as SIGKILL would) at the point that raises it."""


def _in_two_directories(pool: np.ndarray, dirs: list[Path]) -> tuple[Path, int]:
    """K stored, removed, stored again with other bytes in the other one of ``dirs``, and the
    ``DEL`` of its first copy lost: the directory of that copy, and the global slot of K's
    last bytes."""
    with closing(open_store(pool, dirs, 8)) as store:
        store.recover()
        _write(store, pool, b"F", 5)  # global slot 0: K's first copy in directory 1
        _write(store, pool, b"K", 0)  # K's first bytes
        old = dirs[store._index.where[("ns", b"K")][0] % 2]
        assert old == dirs[1] and store.sync(5.0)
        before = (old / "journal.log").read_bytes()
        assert store.remove("ns", b"K")
        for filler in (b"G", b"H", b"I"):  # K stored again with other bytes, in directory 0...
            _write(store, pool, b"K", 2)
            if store._index.where[("ns", b"K")][0] % 2 == 0:
                break
            assert store.remove("ns", b"K")
            _write(store, pool, filler, 6)
        new = store._index.where[("ns", b"K")][0]
        assert new % 2 == 0
    (old / "journal.log").write_bytes(before)  # ...and the DEL of its first copy lost
    return old, new


@pytest.mark.parametrize("end", ["a rewrite refused, then a crash", "a crash between rewrites"])
def test_a_key_dropped_from_two_directories_never_comes_back_from_one_after_a_crash(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """Found by review: a key found in two directories at a start (the ``DEL`` of its older
    copy lost) is dropped, each journal rewritten without it, one after the other; where the
    rewrite of the older copy's directory did not happen (refused for a full disk, or the host
    killed before it), the next start found the key in that directory only and served its older
    bytes, which verify. Both copies' blocks are now overwritten, and synced, before any
    journal is rewritten."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    old = _in_two_directories(disk_pool, dirs)[0]
    real = disk_journal.write_durably

    def cut(path: Path, *data: bytes | bytearray, **kwargs: Any) -> int:
        if path.parent == old:
            if end == "a crash between rewrites":
                raise _Crash
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *data, **kwargs)

    store = open_store(disk_pool, dirs, 8)
    with monkeypatch.context() as m:
        m.setattr(disk_journal, "write_durably", cut)
        m.setattr(store, "_sync_journals", lambda force: None)  # no rewrite again
        with suppress(_Crash):  # the recovery cut short by the crash, or done
            assert b"K" not in {k for _, k, _ in store.recover()}
        store.close()
    with closing(open_store(disk_pool, dirs, 8)) as store:
        found = {key: digest for _, key, digest in store.recover()}
        assert found.get(b"K", digest_of(disk_pool, 2, b"K")) == digest_of(disk_pool, 2, b"K")


def test_a_crash_between_the_overwrites_of_a_key_in_two_directories_never_serves_its_older_copy(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """Found by review: a start overwrites the blocks of a key found in two directories one
    after the other (``disk_recovery._spoil``): a host killed after the newer copy's, before
    the older one's, left the key in one directory, and the next start served its older bytes.
    A block that holds the complement of its record's bytes is now known for a copy so
    overwritten, and every copy of its key is dropped."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    new = _in_two_directories(disk_pool, dirs)[1]
    with open(dirs[new % 2] / "blocks.dat", "r+b") as blocks:  # as the killed start left it
        blocks.seek(new // 2 * DISK_BLOCK)
        block = blocks.read(DISK_BLOCK)
        blocks.seek(new // 2 * DISK_BLOCK)
        blocks.write(bytes(255 - b for b in block))
    for _ in range(2):  # that start, then the next one
        with closing(open_store(disk_pool, dirs, 8)) as store:
            assert b"K" not in {key for _, key, _ in store.recover()}


def test_a_journal_rename_that_fails_after_meta_json_named_it_leaves_both_as_they_were(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``meta.json`` names a compaction's journal before its rename: where the rename then
    fails (EIO), ``meta.json`` names the journal in place again, which is appended to as
    before, so that a crash then finds every key, and no compaction's journal left to
    complete."""
    d = tmp_path / "d"
    real = os.replace

    def failing(src: Any, dst: Any) -> None:
        if Path(dst) == d / "journal.log":
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)
        assert store.sync(5.0)  # K's record written: ``records`` is the test's to set
        with monkeypatch.context() as m:
            m.setattr(os, "replace", failing)
            store._dirs[0].records = 1 << 20  # past 4x the live keys: compacted
            store.poll()
            assert store.sync(5.0) and store._dirs[0].records == 1 << 20  # not compacted
        _write(store, disk_pool, b"L", 1)  # appended to the journal in place
        assert store.sync(5.0)
        meta = json.loads((d / "meta.json").read_text())
        assert meta["generation"] == read_header((d / "journal.log").read_bytes())[1]
        assert not (d / "journal.tmp").exists()
        monkeypatch.setattr(store, "_sync_journals", lambda force: None)  # then a crash
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert sorted(store.recover()) == sorted(
            [
                ("ns", b"K", digest_of(disk_pool, 0, b"K")),
                ("ns", b"L", digest_of(disk_pool, 1, b"L")),
            ]
        )


@pytest.mark.parametrize("room", ["still full", "room again"])
def test_a_key_dropped_from_two_directories_and_stored_again_is_found_though_a_rewrite_failed(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: str
) -> None:
    """Found by review: where a start dropped a key found in two directories and the rewrite
    of one directory's journal was refused (a full disk), that journal still named the key's
    block, overwritten with its complement, so a restart dropped every copy of that key
    (``disk_recovery``: which is the newer is unknown), the one stored since too: a miss where
    a hit was possible, until that journal was rewritten. Once every copy is its complement,
    synced, the blocks are now overwritten again with neither their bytes nor their
    complement: the copy stored since is found, never the old bytes."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    old = _in_two_directories(disk_pool, dirs)[0]
    real = disk_journal.write_durably

    def full(path: Path, *data: bytes | bytearray, **kwargs: Any) -> int:
        if path.parent == old:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *data, **kwargs)

    with closing(open_store(disk_pool, dirs, 8)) as store:
        with monkeypatch.context() as m:
            m.setattr(disk_journal, "write_durably", full)
            assert b"K" not in {k for _, k, _ in store.recover()}
            store._index._turn = 1 - dirs.index(old)  # K stored again, in the other directory
            _write(store, disk_pool, b"K", 7)
            assert store.sync(5.0) and store._dirs[dirs.index(old)].stale
        if room == "room again":
            store._dirs[dirs.index(old)].retry_at = 0.0
            assert store.sync(5.0) and not store._dirs[dirs.index(old)].stale
        monkeypatch.setattr(store, "_sync_journals", lambda force: None)  # then a crash
    with closing(open_store(disk_pool, dirs, 8)) as store:
        found = {key: digest for _, key, digest in store.recover()}
    new = digest_of(disk_pool, 7, b"K")
    assert found.get(b"K") == new
