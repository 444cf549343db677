"""A journal removed because it could not be emptied (``DiskDir._remove``, found by review): a
restart after it serves a key's newest bytes or a miss, never a removed key, whether the
directory's sync of the removal fails (a power loss may undo it) or the file system returns a
block of the removed journal in the next one."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import failing_eio, open_store, write_key

from torch_kv_tier.remote.disk_frames import frame, parse


def journal_files(d: Path) -> Callable[[Any], bool]:
    """Whether a file descriptor is one of ``d``'s journals (``journal.log``, ``journal.tmp``):
    a device whose sectors under them fail, ``meta.json``'s still written."""

    def journal(target: Any) -> bool:
        try:
            name = os.readlink(f"/proc/self/fd/{target}")
        except (OSError, TypeError):
            return False
        return name.startswith(f"{d}{os.sep}journal.")

    return journal


def the_directory(d: Path) -> Callable[[Any], bool]:
    """Whether a file descriptor is directory ``d`` itself (its ``fsync``: a rename's, an
    unlink's)."""

    def directory(target: Any) -> bool:
        try:
            return isinstance(target, int) and os.readlink(f"/proc/self/fd/{target}") == str(d)
        except OSError:
            return False

    return directory


def remove_with_a_failing_journal(
    store: Any, pool: np.ndarray, d: Path, m: pytest.MonkeyPatch
) -> None:
    """Store keys ``A``..``F`` then ``K``, synced; then fail every write and truncation of
    ``d``'s journals (EIO) and remove ``K``: its ``DEL`` is dropped, the journal neither
    emptied nor rewritten, so it is removed (``_remove``)."""
    for i, key in enumerate([b"A", b"B", b"C", b"D", b"E", b"F", b"K"]):
        assert write_key(store, pool, key, i).written
    assert store.sync(5.0)
    journals = journal_files(d)
    for name in ("write", "ftruncate"):
        m.setattr(os, name, failing_eio(getattr(os, name), journals))
    assert store.remove("ns", b"K")


def test_a_removal_whose_directory_sync_failed_is_not_said_synced(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """The journal was removed, but the directory's sync that makes the removal durable failed
    (EIO), and ``sync`` said done: a power loss then undoes the removal (the journal and
    ``meta.json`` as the last directory sync left them) and the restart serves the key
    removed. ``sync`` now says False until the journal is rewritten."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        with pytest.MonkeyPatch.context() as m:
            remove_with_a_failing_journal(store, disk_pool, d, m)
            before = {n: (d / n).read_bytes() for n in ("journal.log", "meta.json")}
            m.setattr(os, "fsync", failing_eio(os.fsync, the_directory(d)))
            synced = store.sync(5.0)
            assert not (d / "journal.log").exists(), "the journal was not removed"
            shutil.copytree(d, tmp_path / "lost")  # a power loss: the directory's entries undone
    for name, data in before.items():
        (tmp_path / "lost" / name).write_bytes(data)
    with closing(open_store(disk_pool, [tmp_path / "lost"], 8)) as restarted:
        found = {key for _, key, _ in restarted.recover()}
    assert not (synced and b"K" in found), "sync said done, and a power loss brought K back"


def test_a_removed_journals_block_in_the_next_journal_brings_no_removed_key_back(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """The journal removed had no header naming an order past its records (as an emptied one
    has): the restart numbered its new journal from ``meta.json``'s generation, below the
    removed journal's last records, so the removed journal's last block returned by the file
    system in the new one after a crash (its ``PUT`` of ``K``, whose ``DEL`` was dropped) read
    as a record of it, in order: ``K``, removed, was served. ``meta.json`` now names a
    generation past every record framed as the journal is removed."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        with pytest.MonkeyPatch.context() as m:
            remove_with_a_failing_journal(store, disk_pool, d, m)
            old = (d / "journal.log").read_bytes()
            generation = json.loads((d / "meta.json").read_text())["generation"]
            store.sync(5.0)
            assert not (d / "journal.log").exists(), "the journal was not removed"
            shutil.copytree(d, tmp_path / "killed")  # a SIGKILL here
    killed = tmp_path / "killed"
    with closing(open_store(disk_pool, [killed], 8)) as restarted:
        assert restarted.recover() == []
    put_k = parse(old, generation=generation).records[-1]
    assert put_k[3] == b"K"
    block = next(f for seq in range(1 << 12) if old.endswith(f := frame(put_k, seq)))
    with open(killed / "journal.log", "ab") as journal:  # the file system's old block
        journal.write(block)
    with closing(open_store(disk_pool, [killed], 8)) as again:
        found = {key for _, key, _ in again.recover()}
    assert b"K" not in found, "the key removed came back from the removed journal's block"


def test_a_host_killed_after_the_removal_starts_twice_with_misses(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """A host killed right after the journal's removal, started twice (the first start killed
    too, before its rewrite): each start finds none of the directory's keys, and a key stored
    after them is found."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        with pytest.MonkeyPatch.context() as m:
            remove_with_a_failing_journal(store, disk_pool, d, m)
            store.sync(5.0)
            shutil.copytree(d, tmp_path / "killed")
    killed = tmp_path / "killed"
    first = open_store(disk_pool, [killed], 8)
    try:
        assert first.recover() == []
        shutil.copytree(killed, tmp_path / "again")  # the first start killed
    finally:
        first.close()
    with closing(open_store(disk_pool, [tmp_path / "again"], 8)) as second:
        assert second.recover() == []
        assert write_key(second, disk_pool, b"K", 7).written and second.sync(5.0)
    with closing(open_store(disk_pool, [tmp_path / "again"], 8)) as third:
        assert [key for _, key, _ in third.recover()] == [b"K"]


def test_a_journal_not_removable_is_made_another_generations(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """The journal could be neither emptied nor removed, but ``meta.json`` could be written:
    it names a generation past the journal's, so a restart uses none of its records (the key
    removed, and the others, misses), and ``sync`` says done."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        with pytest.MonkeyPatch.context() as m:
            remove_with_a_failing_journal(store, disk_pool, d, m)
            m.setattr(os, "unlink", failing_eio(os.unlink, lambda p: str(p).endswith(".log")))
            synced = store.sync(5.0)
            assert (d / "journal.log").exists()
            shutil.copytree(d, tmp_path / "killed")  # a SIGKILL here
    with closing(open_store(disk_pool, [tmp_path / "killed"], 8)) as restarted:
        assert synced and restarted.recover() == [], "the journal not removed was used"


def test_keys_stored_after_the_removal_are_misses_until_the_rewrite_then_found(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """Keys stored after the journal's removal (their records dropped, the journal stale) are
    misses at a restart before its rewrite, never older bytes; once the device answers, the
    rewrite makes a fresh ``journal.log`` (renamed where there is none) that ``meta.json``
    names, and a restart finds every key kept, the removed one still a miss."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        with pytest.MonkeyPatch.context() as m:
            remove_with_a_failing_journal(store, disk_pool, d, m)
            assert write_key(store, disk_pool, b"L", 7).written and store.sync(5.0)
            shutil.copytree(d, tmp_path / "before")  # a SIGKILL before the rewrite
        store._dirs[0].retry_at = 0.0  # the device answers: rewritten now
        assert store.sync(5.0) and not store._dirs[0].stale
        shutil.copytree(d, tmp_path / "after")
    with closing(open_store(disk_pool, [tmp_path / "before"], 8)) as restarted:
        assert restarted.recover() == []
    meta = json.loads((tmp_path / "after" / "meta.json").read_text())
    journal = (tmp_path / "after" / "journal.log").read_bytes()
    assert parse(journal, generation=meta["generation"]).bad_at is None
    with closing(open_store(disk_pool, [tmp_path / "after"], 8)) as restarted:
        found = {key for _, key, _ in restarted.recover()}
    assert found == {b"A", b"B", b"C", b"D", b"E", b"F", b"L"}
