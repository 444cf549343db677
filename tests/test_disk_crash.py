"""A disk directory's crash consistency, failure by failure (found by review): a header cut or
corrupted, a start refused for want of space, a journal write cut short, a journal cut at its
tail or damaged in the middle, a compaction cut short or renamed without its directory synced,
blocks never synced before the journal records naming them."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import (
    DISK_BLOCK,
    digest_of,
    failing_eio,
    open_store,
    put_records,
    under,
    write_key,
)

from torch_kv_tier.remote import (
    disk_frames,
    disk_journal,
    disk_replay,
)
from torch_kv_tier.remote.disk_frames import DEL, PUT
from torch_kv_tier.remote.disk_journal import DiskDir
from torch_kv_tier.remote.disk_store import DiskError


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
        assert write_key(store, disk_pool, b"k", 3).written
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
            write_key(store, disk_pool, b"k0", 0).written
            and write_key(store, disk_pool, b"k1", 1).written
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
        assert write_key(store, disk_pool, b"k2", 2).written  # its record: logged, not raised
        assert store.sync(10.0)  # the journals' thread: its writes done
        assert len(calls) == 3  # the rest of its record, then the header of the journal emptied
        monkeypatch.undo()
        assert write_key(store, disk_pool, b"k3", 3).written
        assert store.sync(10.0)
        kept = {key for _, _, _, key, _ in d.read_records()}  # what a crash now would find
        assert {b"k0", b"k1", b"k3"} <= kept


def _journal_of_four_keys(disk_pool: np.ndarray, d: Path, *, remove_k: bool) -> Path:
    """A directory whose journal holds ``PUT`` records of K, X, Y and Z (blocks of DRAM slots 0
    to 3), then, with ``remove_k``, K's ``DEL`` (K committed again with other bytes)."""
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        for i, key in enumerate([b"K", b"X", b"Y", b"Z"]):
            assert write_key(store, disk_pool, key, i).written
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
        caplog.at_level(logging.WARNING, logger=disk_replay.__name__),
        closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store,
    ):
        assert sorted(k for _, k, _ in store.recover()) == [b"K", b"X", b"Y"]
    said = [r.getMessage() for r in caplog.records if r.name == disk_replay.__name__]
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
        caplog.at_level(logging.WARNING, logger=disk_replay.__name__),
        closing(open_store(disk_pool, [d], 8)) as store,
    ):
        assert store.recover() == []
        assert store.stats()["disk_recover_dropped"] == 2  # Y and Z
    said = [r.getMessage() for r in caplog.records if r.name == disk_replay.__name__]
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
        live = put_records(50)
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:100]))
        d.rewrite(live)
        monkeypatch.undo()
        assert d.read_records() == live

        def full(fd: int, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", full)
        assert not d.rewrite(put_records(10))  # logged, not raised; the journal stays as it was
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
        live = put_records(3)
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
        d.rewrite(put_records(3))
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
        assert write_key(store, disk_pool, b"k", 0).written
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


@pytest.mark.parametrize("unlink", ["removable", "not removable"])
def test_a_removal_whose_record_and_the_journals_emptying_failed_never_comes_back(
    disk_pool: np.ndarray, tmp_path: Path, unlink: str
) -> None:
    """Found by review, extending the crash fuzzer to three faults at once: a failing device
    (EIO) refused the ``DEL`` of a key removed, then the emptying of its journal, and a restart
    before the journal's rewrite (refused too) served the key removed, while ``sync`` had said
    it was done. The journal is now removed where it cannot be emptied (a restart finds none of its
    blocks); where it cannot be removed either, ``sync`` says False."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        assert write_key(store, disk_pool, b"K", 3).written and store.sync(5.0)
        ours = under(d)
        failing = ["write", "ftruncate"] + (["unlink"] if unlink == "not removable" else [])
        with pytest.MonkeyPatch.context() as m:
            for name in failing:
                m.setattr(os, name, failing_eio(getattr(os, name), ours))
            assert store.remove("ns", b"K")
            synced = store.sync(5.0)
            shutil.copytree(d, tmp_path / "killed")  # a SIGKILL here
    with closing(open_store(disk_pool, [tmp_path / "killed"], 8)) as restarted:
        found = restarted.recover()
    if unlink == "removable":
        assert synced and found == [], "the key removed came back"
    else:
        assert not synced, "sync said done, and a restart may bring the key removed back"
