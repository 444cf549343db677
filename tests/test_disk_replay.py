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
import struct
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from disk_support import as_format_1, digest_of, open_store, settle

from torch_kv_tier.remote import disk_journal
from torch_kv_tier.remote.disk_frames import PUT, parse
from torch_kv_tier.remote.disk_store import DiskStore


def _write(store: DiskStore, pool: np.ndarray, key: bytes, dram: int) -> None:
    store.write([("ns", key, digest_of(pool, dram, key), dram)])
    assert settle(store).written == [("ns", key)]


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
    end = 0
    for _ in range(copied):  # the frames of K's first PUT, and of the records after it
        end += 8 + struct.unpack_from("<I", data, end)[0]
    journal.write_bytes(data + data[:end])  # written again, at the journal's end
    with closing(open_store(disk_pool, [d], 8)) as store:
        found = {key: digest for _, key, digest in store.recover()}
        assert found.get(b"K", digest_of(disk_pool, 2, b"K")) == digest_of(disk_pool, 2, b"K")
        if b"K" in found:  # what a load of it returns
            store.read([("ns", b"K", 40)])
            assert len(settle(store).read) == 1
            assert np.array_equal(disk_pool[40], disk_pool[2])


@pytest.mark.parametrize("full_at_start", [False, True])
def test_a_directory_of_the_format_before_record_orders_keeps_its_blocks_as_it_is_migrated(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    full_at_start: bool,
) -> None:
    """A host upgraded in place stopped at start, refusing its --disk directories (format 1,
    whose records carry no order), every block lost once moved away. Their journals are now
    read as format 1, rewritten as this format, and only then their headers: every key is
    kept, also where the rewrite at start fails (a full disk: migrated by the rewrite after)."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)
        _write(store, disk_pool, b"J", 1)
        assert store.remove("ns", b"J")
    as_format_1(d)
    want = [("ns", b"K", digest_of(disk_pool, 0, b"K"))]
    if full_at_start:
        with closing(open_store(disk_pool, [d], 8)) as store:

            def full(*args: object) -> int:
                raise OSError(errno.ENOSPC, "No space left on device")

            with monkeypatch.context() as m:
                m.setattr(disk_journal, "write_durably", full)
                assert store.recover() == want  # its journal stale: rewritten later
            assert json.loads((d / "meta.json").read_text())["format"] == 1
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
        (record,) = parse(data[pos:end]).records
        if record[:2] == (op, slot) and record[3] == key:
            return data[pos:end]
        pos = end
    raise AssertionError(f"no record {op} of {key!r} at slot {slot}")


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
        for _ in range(5):  # records before K's: its order is past the restart's first ones
            _write(store, disk_pool, b"F", 3)
            assert store.remove("ns", b"F")
        _write(store, disk_pool, b"K", 0)  # slot 0: K's first bytes
        _write(store, disk_pool, b"X", 1)  # slot 1
        assert store.remove("ns", b"K") and store.remove("ns", b"X")  # slot 0 keeps K's bytes
        _write(store, disk_pool, b"K", 2)  # K stored again with other bytes: slot 1
        assert store.sync(5.0)
        old = (d / "journal.log").read_bytes()
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
