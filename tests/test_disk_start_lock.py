"""A host started on a directory another host still holds (a restart whose old host is still
stopping): it waits for the directory's lock (``disk_files.lock``), then reads the directory as
the old host left it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from torch_kv_tier.remote import disk_journal
from torch_kv_tier.remote.disk_frames import PUT
from torch_kv_tier.remote.disk_journal import DiskDir

BLOCK = 4096


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
