"""A disk request that hangs (a stuck device, NFS), and a store closed with requests or journal
syncs still in flight (found by review): a request given up lands its late bytes nowhere, what
it may still touch (the pool, the files, the NIXL agent) is never freed, not even at
interpreter shutdown; a request the device cannot answer at once never blocks its poster; a
kernel without io_uring still gets a disk tier."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import (
    HungDevice,
    digest_of,
    make_disk_pool,
    open_store,
    poll_until,
    run_script,
    settle,
    write_key,
)

from torch_kv_tier.remote import (
    disk_files,
    disk_store,
)
from torch_kv_tier.remote.disk_io import DiskTransfers
from torch_kv_tier.remote.disk_store import DiskError


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
        assert write_key(store, disk_pool, b"K", 0).written
        assert write_key(store, disk_pool, b"M", 1).written
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
    assert write_key(store, pool, b"K", 0).written
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
    assert write_key(store, disk_pool, b"K", 0).written
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
        assert write_key(store, disk_pool, b"k", 0).written
        store.read([("ns", b"k", 40)])
        assert len(settle(store).read) == 1 and np.array_equal(disk_pool[40], disk_pool[0])
    finally:
        store.close()
