"""Helpers of the disk tier's tests on real files (``DiskStore``): the block geometry, a store
over a test's pool (the ``disk_pool`` fixture, ``conftest``), a block's digest, I/O settled or
polled for, a script run in a process of its own, a device that hangs, a directory as disk format
1 made it, a copy of directories at each file step (a host killed there)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import xxhash

from torch_kv_tier.keys import Key, key_fingerprint
from torch_kv_tier.remote.disk_frames import PUT, Record, parse, read_header
from torch_kv_tier.remote.disk_store import DiskCompletions, DiskStore

DISK_BLOCK = 16 << 10
DISK_POOL = 64  # DRAM slots of ``disk_pool``


def make_disk_pool() -> np.ndarray:
    """``DISK_POOL`` page-aligned rows of ``DISK_BLOCK`` random bytes (as the server's pool)."""
    raw = np.empty(DISK_POOL * DISK_BLOCK + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    rows = raw[start : start + DISK_POOL * DISK_BLOCK].reshape(DISK_POOL, DISK_BLOCK)
    rows[:] = np.random.default_rng(0).integers(0, 256, rows.shape, dtype=np.uint8)
    return rows


def open_store(pool: np.ndarray, dirs: list[Path], slots: int) -> DiskStore:
    """A store of ``slots`` blocks per directory over ``pool``."""
    return DiskStore(
        [str(d) for d in dirs],
        slots * DISK_BLOCK,
        block_len=DISK_BLOCK,
        pool_addr=pool.ctypes.data,
        pool_blocks=len(pool),
        pool_owner=pool,
    )


def write_key(store: DiskStore, pool: np.ndarray, key: Key, dram: int) -> DiskCompletions:
    """Write ``pool``'s DRAM slot ``dram`` as ``key``; poll until that write is done or failed
    (one refused as it starts: failed at the next poll), at most ``SETTLE_TIMEOUT_S``."""
    store.write([("ns", key, digest_of(pool, dram, key), dram)])
    done = DiskCompletions()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while store.in_flight() or not (done.written or done.failed):
        assert time.monotonic() < deadline, f"the write of {key!r} neither done nor failed"
        more = store.poll()
        done.written += more.written
        done.failed += more.failed
    return done


def put_records(n: int) -> list[Record]:
    """``n`` ``PUT`` records: ``key-i`` in slot ``i``, digest ``i``."""
    return [(PUT, i, "ns", f"key-{i}".encode(), i) for i in range(n)]


def digest_of(pool: np.ndarray, slot: int, key: Key) -> int:
    """The digest of ``pool``'s DRAM slot holding ``key``."""
    return xxhash.xxh3_64_intdigest(pool[slot], key_fingerprint(key))


SETTLE_TIMEOUT_S = 20.0  # before a request is given up (``REQUEST_TIMEOUT_S``): said as such


def settle(store: DiskStore, timeout: float = SETTLE_TIMEOUT_S) -> DiskCompletions:
    """Poll until no I/O is in flight; every completion seen. Raises ``AssertionError`` saying
    how many requests are still in flight after ``timeout`` seconds: a request that never ends
    (a hung device, a store given a long ``request_timeout_s``) fails the test, never hangs it."""
    done = DiskCompletions()
    deadline = time.monotonic() + timeout
    while store.in_flight():
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"{store.in_flight()} disk requests still in flight after {timeout:.0f} s "
                f"(stuck: {store.stats()['disk_stuck_in_flight']})"
            )
        more = store.poll()
        done.written += more.written
        done.read += more.read
        done.failed += more.failed
        time.sleep(0.001)  # the device's requests are polled, not awaited: leave it the CPU
    return done


def poll_until(store: DiskStore, what: str) -> dict[str, list[Any]]:
    """Poll (at most 10 s) until ``what`` (a ``DiskCompletions`` field) is not empty; what
    every field collected."""
    done: dict[str, list[Any]] = {}
    deadline = time.monotonic() + 10.0
    while not done.get(what) and time.monotonic() < deadline:
        for name, items in vars(store.poll()).items():
            done.setdefault(name, []).extend(items)
        time.sleep(0.01)
    assert done.get(what), f"nothing {what} within 10 s"
    return done


def run_script(script: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (Python, ``directory`` its ``sys.argv[1]``) in a process of its own, with
    this run's import path, for at most 120 s; its output captured. Raises ``AssertionError``
    with the tail of its stderr if it exits failed."""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


class HungDevice:
    """A device that stops answering: the requests ``store`` posts while it ``hangs`` are
    made but not started, and stay in flight; ``resume`` starts them (their bytes land late,
    as a stuck device's or NFS's do) and lets them end."""

    def __init__(self, store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.agent, self.io = store._io._agent, store._io
        self.real_transfer, real_state = self.agent.transfer, self.io.state
        self.held: list[Any] = []
        self.hangs = True

        def transfer(handle: Any) -> str:
            if not self.hangs:
                return str(self.real_transfer(handle))
            self.held.append(handle)
            return "PROC"

        def state(handle: Any, kind: str, f: int) -> str:
            return "PROC" if handle in self.held else real_state(handle, kind, f)

        monkeypatch.setattr(self.agent, "transfer", transfer)
        monkeypatch.setattr(self.io, "state", state)

    def resume(self) -> None:
        held, self.held = self.held, []
        for handle in held:
            assert self.real_transfer(handle) != "ERR"


def as_format(d: Path, fmt: int) -> None:
    """Turn directory ``d`` (closed) into the one disk format ``fmt`` would have made: its
    header names that format and no journal generation, its journal starts with no header;
    in format 1 its records carry no order."""
    meta = json.loads((d / "meta.json").read_text())
    data = (d / "journal.log").read_bytes()
    parsed = parse(data, generation=meta.pop("generation"))
    assert parsed.bad_at is None, "a whole journal of this format"
    journal = data[read_header(data)[0] :]  # its records as they were
    if fmt == 1:
        payloads = [msgspec.msgpack.encode(r) for r in parsed.records]
        journal = b"".join(struct.pack("<II", len(p), zlib.crc32(p)) + p for p in payloads)
    (d / "journal.log").write_bytes(journal)
    (d / "meta.json").write_text(json.dumps({**meta, "format": fmt}))


def under(d: Path) -> Callable[[Any], bool]:
    """Whether a file descriptor's file, or a path, is under directory ``d``."""

    def of_d(target: Any) -> bool:
        if not isinstance(target, int):
            return d in Path(target).parents
        try:
            return os.readlink(f"/proc/self/fd/{target}").startswith(f"{d}{os.sep}")
        except OSError:
            return False

    return of_d


def failing_eio(real: Callable[..., Any], ours: Callable[[Any], bool]) -> Callable[..., Any]:
    """``real`` (an ``os`` call on a file descriptor or path) failing (EIO) for the files
    ``ours`` (``under``)."""

    def call(target: Any, *args: Any) -> Any:
        if ours(target):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(target, *args)

    return call


def copy_at_each_step(
    monkeypatch: pytest.MonkeyPatch,
    d: Path,
    out: list[Path],
    on_copy: Callable[[], object] = lambda: None,
) -> None:
    """Copy ``d`` into ``out`` (``d``'s parent's ``killed-N``, N its index there), then call
    ``on_copy``, before each write (a block's too), sync, truncation and rename of the files
    under it (and after each rename): each copy is the directories of a host killed at that
    step (a SIGKILL keeps the page cache)."""
    ours = under(d)

    def snap() -> None:
        out.append(d.parent / f"killed-{len(out)}")
        shutil.copytree(d, out[-1])
        on_copy()

    def before(real: Callable[..., Any]) -> Callable[..., Any]:
        def step(fd: int, *args: Any) -> Any:
            if ours(fd):
                snap()
            return real(fd, *args)

        return step

    for name in ("write", "pwritev", "fsync", "fdatasync", "ftruncate"):
        monkeypatch.setattr(os, name, before(getattr(os, name)))
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        mine = ours(dst)
        if mine:
            snap()
        real_replace(src, dst)
        if mine:
            snap()

    monkeypatch.setattr(os, "replace", replace)
