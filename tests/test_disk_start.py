"""What a start finds of the files a host left: where it started while that host still held the
directory (a restart whose old host is still stopping), the directory as that host left it;
where a rewrite of the journal failed after ``meta.json`` named the new one, no key removed
since; where a key is in two directories and a copy of it cannot be read, not its older copy."""

from __future__ import annotations

import errno
import math
import os
import select
import subprocess
import sys
import threading
from contextlib import closing, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import DISK_BLOCK, digest_of, open_store, under
from test_disk_replay import _Crash, _in_two_directories, _write

from torch_kv_tier.remote import disk_files, disk_header, disk_journal
from torch_kv_tier.remote.disk_frames import PUT
from torch_kv_tier.remote.disk_journal import DiskDir, DiskError

BLOCK = 4096
_HOLDS = """
import sys
from pathlib import Path
from torch_kv_tier.remote.disk_journal import DiskDir
held = DiskDir(Path(sys.argv[1]), 4 * 4096, 4096, direct=False)
print("held", flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_second_host_on_a_directory_is_refused_naming_the_first_and_changes_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a host started on a directory another host's process holds was refused
    without saying which process holds it (``ps`` and guessing to find which host to stop). It
    now names that process's pid, changes none of the directory's files, and once that process
    is killed, a start is no longer refused (its lock went with it)."""
    d = tmp_path / "d"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    host = subprocess.Popen(
        [sys.executable, "-c", _HOLDS, str(d)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert host.stdout is not None and select.select([host.stdout], [], [], 60.0)[0]
        assert host.stdout.readline() == "held\n", "the first host did not start"
        files = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in d.iterdir()}
        monkeypatch.setattr(disk_files, "LOCK_WAIT_S", 0.2)
        refused = f"{d} is in use by another disk tier, process {host.pid} .*stop that host"
        with pytest.raises(DiskError, match=refused):
            DiskDir(d, 4 * BLOCK, BLOCK, direct=False)
        assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in d.iterdir()} == files
    finally:
        host.kill()
        host.wait(60.0)
    DiskDir(d, 4 * BLOCK, BLOCK, direct=False).close()  # killed: its lock is no longer held


def test_a_start_that_waited_for_the_lock_keeps_the_keys_of_the_old_hosts_last_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a start read ``meta.json`` before it waited for the lock, so where the
    host holding it rewrote its journal meanwhile (a compaction as it stopped), the start
    named the old generation, found the new journal's header naming another, and used none of
    its records (every key of that directory a miss). ``meta.json`` is now read under the
    lock."""
    d = tmp_path / "d"
    old = DiskDir(d, 4 * BLOCK, BLOCK, direct=False)
    old.append(PUT, 0, "ns", b"K", 7)
    old.flush(*old.take_pending(), sync=True)
    waiting = threading.Event()
    real_lock = disk_journal.lock

    def lock(fd: int, path: Path) -> None:
        waiting.set()
        real_lock(fd, path)

    monkeypatch.setattr(disk_journal, "lock", lock)
    started: list[DiskDir] = []
    new = threading.Thread(target=lambda: started.append(DiskDir(d, 4 * BLOCK, BLOCK)))
    new.start()
    try:
        assert waiting.wait(10.0)  # the new host waits for the lock
        assert old.rewrite([(PUT, 0, "ns", b"K", 7)], compaction=True)  # a new generation
    finally:
        old.close()  # the old host stops: the lock is the new host's
        new.join(10.0)
    assert not new.is_alive() and started
    try:
        assert started[0].live() == {0: (0, "ns", b"K", 7)}
    finally:
        started[0].close()


@pytest.mark.parametrize("journal", ["appended to", "stale", "appended to, then a full disk"])
def test_a_rewrite_whose_rename_and_cleanup_failed_never_brings_back_a_key_removed_since(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: str
) -> None:
    """Found by review: a rewrite of the journal whose rename failed (EIO) after ``meta.json``
    named the new journal, where neither ``journal.tmp`` could be removed nor ``meta.json``
    name the old journal again, left ``journal.tmp`` named by ``meta.json``; the host went on
    (a compaction's journal appended to as before, a stale one dropping records), removed K,
    and the next start completed that rename (``disk_header.roll_forward``): K came back. A
    start now completes it only where ``journal.tmp`` holds every record of ``journal.log``
    (none past its last), and a stale journal's next dropped record empties it again. Where
    that emptied journal's header was refused too (a full disk), ``journal.log`` was left empty,
    holding no record past ``journal.tmp``'s, and K came back: a start no longer completes a
    rename over an empty ``journal.log`` (its keys were misses already)."""
    d = tmp_path / "d"
    real_replace, real_unlink, real_meta = os.replace, Path.unlink, disk_header.write_durably
    named: list[Path] = []

    def replace(src: Any, dst: Any) -> None:
        if Path(dst) == d / "journal.log":
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        if path == d / "journal.tmp":
            raise OSError(errno.EIO, "Input/output error")
        real_unlink(path, missing_ok)

    def meta_once(path: Path, *data: bytes | bytearray, **kwargs: Any) -> int:
        named.append(path)
        if len(named) > 1:  # ``_name_again``'s
            raise OSError(errno.EIO, "Input/output error")
        return real_meta(path, *data, **kwargs)

    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        _write(store, disk_pool, b"K", 0)
        _write(store, disk_pool, b"J", 1)
        assert store.sync(5.0)
        dir0 = store._dirs[0]
        if journal == "stale":  # a sync refused: the journal emptied, rewritten later
            with monkeypatch.context() as m:
                m.setattr(os, "fdatasync", _refused)
                _write(store, disk_pool, b"L", 2)
                assert store.sync(5.0) and dir0.stale
        with monkeypatch.context() as m:
            m.setattr(os, "replace", replace)
            m.setattr(Path, "unlink", unlink)
            m.setattr(disk_header, "write_durably", meta_once)
            dir0.records, dir0.retry_at = 1 << 20, 0.0  # past 4x the live keys: compacted now
            store.poll()
            assert store._journals.wait(5.0) and len(named) == 2
        assert (d / "journal.tmp").exists()
        dir0.retry_at = math.inf  # the crash comes before the rewrite is tried again
        assert store.remove("ns", b"K")
        with monkeypatch.context() as m:
            if journal.endswith("full disk"):  # the DEL refused, then the emptied journal's header
                m.setattr(os, "write", _full_under(d, os.write))
            store.poll()  # its record written (a stale journal: dropped)
            assert store._journals.wait(5.0)
        if journal.endswith("full disk"):
            assert (d / "journal.log").stat().st_size == 0
        monkeypatch.setattr(store, "_sync_journals", lambda force: None)  # then a crash
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert b"K" not in {key for _, key, _ in store.recover()}


@pytest.mark.parametrize("rewrite", ["done", "refused"])
@pytest.mark.parametrize("unreadable", ["newer", "older"])
def test_a_key_in_two_directories_with_a_copy_unreadable_is_never_served_old(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    unreadable: str,
    rewrite: str,
) -> None:
    """Found by review: a key in two directories (the ``DEL`` of its older copy lost) whose
    newer copy's block could not be read at a start (EIO: a bad sector) was found in the other
    directory only, and its older bytes served. A copy that cannot be read now counts as one
    (``disk_recovery``): every copy is dropped, and the unreadable one is overwritten unread
    once the other is marked, so that where it reads again at the next start, its journal not
    rewritten (refused: a full disk), it is no older copy found alone either."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    old, new = _in_two_directories(disk_pool, dirs)
    at = dirs[new % 2] if unreadable == "newer" else old
    slot = new // 2 if unreadable == "newer" else 0  # K's first copy: global slot 1
    real_read, real_write, ours = os.preadv, disk_journal.write_durably, under(at)
    unread: list[int] = []

    def bad_sector(fd: int, buffers: Any, offset: int) -> int:
        if ours(fd) and offset == slot * DISK_BLOCK and not unread:  # K's, as the start reads
            unread.append(offset)
            raise OSError(errno.EIO, "Input/output error")
        return int(real_read(fd, buffers, offset))

    def full(path: Path, *data: bytes | bytearray, **kwargs: Any) -> int:
        if path.parent == at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, *data, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "preadv", bad_sector)
        if rewrite == "refused":
            m.setattr(disk_journal, "write_durably", full)
        with closing(open_store(disk_pool, dirs, 8)) as store:
            found = {key: digest for _, key, digest in store.recover()}
            monkeypatch.setattr(store, "_sync_journals", lambda force: None)  # then a crash
    assert unread and found.get(b"K") in (None, digest_of(disk_pool, 2, b"K"))
    with closing(open_store(disk_pool, dirs, 8)) as store:  # the block reads again
        found = {key: digest for _, key, digest in store.recover()}
    assert found.get(b"K") in (None, digest_of(disk_pool, 2, b"K"))


def test_a_key_in_two_directories_whose_older_copy_cannot_be_overwritten_keeps_its_mark(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that drops a key found in two directories overwrites each copy with its
    complement, then, where every copy was, overwrites them again with bytes that mark nothing
    (``disk_recovery._spoil``). Where the older copy's block could not be overwritten (EIO),
    the newer copy keeps its complement: a crash before the journals are rewritten leaves the
    older copy, which still verifies, found with a marked one, never alone."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    old = _in_two_directories(disk_pool, dirs)[0]
    real_write, ours = os.pwritev, under(old)

    def refused(fd: int, buffers: Any, offset: int) -> int:
        if ours(fd):
            raise OSError(errno.EIO, "Input/output error")
        return int(real_write(fd, buffers, offset))

    def crash(path: Path, *data: bytes | bytearray, **kwargs: Any) -> int:
        raise _Crash

    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", refused)
        m.setattr(disk_journal, "write_durably", crash)  # killed before any rewrite
        store = open_store(disk_pool, dirs, 8)
        with suppress(_Crash):
            store.recover()
        m.setattr(store, "_sync_journals", lambda force: None)
        store.close()
    with closing(open_store(disk_pool, dirs, 8)) as store:
        assert b"K" not in {key for _, key, _ in store.recover()}


def _full_under(d: Path, real: Any) -> Any:
    """``os.write`` refusing (ENOSPC) every write to a file under ``d``."""
    ours = under(d)

    def write(fd: int, data: Any) -> int:
        if ours(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(real(fd, data))

    return write


def _refused(fd: int) -> None:
    raise OSError(errno.EIO, "Input/output error")
