"""A host killed at each step of the disk tier's file writes (a restart's rewrite of the journal,
a compaction, a migration from disk formats 1 and 2, a compaction after one whose ``meta.json``
was refused, a start that drops a key found in two directories): the directories as that step
leaves them, which is what a SIGKILL leaves (the page
cache is kept), is started, then started again. Found by review: a host killed between the
rename of a new journal and the write of ``meta.json`` naming its generation lost every key of
that directory at the next start (the journal's header named another generation). ``meta.json``
is now written before the rename, and a start completes a rename cut by a crash
(``disk_header.roll_forward``): each start finds every key with its last bytes, and the second
says nothing."""

from __future__ import annotations

import errno
import logging
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import as_format, copy_at_each_step, digest_of, open_store
from test_disk_replay import _in_two_directories, _write

from torch_kv_tier.remote import disk_header
from torch_kv_tier.remote.disk_store import DiskStore


def _history(store: DiskStore, pool: np.ndarray) -> dict[bytes, int]:
    """Keys stored, removed, stored again with other bytes; returns the digest each key's last
    bytes have (a removed key: none)."""
    _write(store, pool, b"K", 0)  # K's first bytes, kept in their slot once removed
    _write(store, pool, b"X", 1)
    assert store.remove("ns", b"K") and store.remove("ns", b"X")
    _write(store, pool, b"K", 2)
    _write(store, pool, b"J", 3)
    _write(store, pool, b"R", 4)
    assert store.remove("ns", b"R") and store.sync(5.0)
    return {b"K": digest_of(pool, 2, b"K"), b"J": digest_of(pool, 3, b"J")}


def _compact(store: DiskStore) -> None:
    store._dirs[0].records = 1 << 20  # past 4x the live keys: compacted
    store._dirs[0].retry_at = 0.0  # now, where one failed
    store.poll()
    assert store.sync(5.0)


def _meta_refused_once(store: DiskStore, pool: np.ndarray, want: dict[bytes, int]) -> None:
    """A compaction whose ``meta.json`` a full disk refuses, then more changes."""
    real = disk_header.write_durably

    def full(path: Path, *data: bytes | bytearray, **kwargs: Any) -> int:
        if path.name == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *data, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(disk_header, "write_durably", full)
        _compact(store)
    _write(store, pool, b"L", 6)
    assert store.remove("ns", b"J")
    del want[b"J"]
    want[b"L"] = digest_of(pool, 6, b"L")
    assert store.sync(5.0)


@pytest.mark.parametrize(
    "killed_in",
    ["a restart", "a compaction", "format 1", "format 2", "a meta.json refused", "two directories"],
)
def test_a_host_killed_at_any_step_of_a_rewrite_serves_no_old_bytes_and_starts_clean_after(
    disk_pool: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    killed_in: str,
) -> None:
    root = tmp_path / "root"
    killed: list[Path] = []
    names, slots = (["a", "b"], 8) if killed_in == "two directories" else (["d"], 16)
    d = root / names[0]
    if killed_in == "two directories":  # K's older copy found with its newer one: dropped
        _in_two_directories(disk_pool, [root / name for name in names])
    else:
        with closing(open_store(disk_pool, [d], slots)) as store:
            store.recover()
            want = _history(store, disk_pool)
            if killed_in == "a meta.json refused":
                _meta_refused_once(store, disk_pool, want)
            if killed_in in ("a compaction", "a meta.json refused"):
                with monkeypatch.context() as m:
                    copy_at_each_step(m, root, killed)
                    _compact(store)
    if killed_in.startswith("format"):
        as_format(d, int(killed_in[-1]))
    if killed_in in ("a restart", "format 1", "format 2", "two directories"):
        with (
            monkeypatch.context() as m,
            closing(open_store(disk_pool, [root / name for name in names], slots)) as store,
        ):
            copy_at_each_step(m, root, killed)
            found = {key: digest for _, key, digest in store.recover()}
        if killed_in == "two directories":
            assert b"K" not in found and b"F" in found
            want = found
        assert found == want
    assert len(killed) > 5
    for at in killed:
        with closing(open_store(disk_pool, [at / name for name in names], slots)) as store:
            found = {key: digest for _, key, digest in store.recover()}
        assert found == want, at.name
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="torch_kv_tier"),
            closing(open_store(disk_pool, [at / name for name in names], slots)) as store,
        ):
            assert {key: digest for _, key, digest in store.recover()} == found, at.name
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
