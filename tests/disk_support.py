"""Helpers of the disk tier's tests on real files (``DiskStore``): the block geometry, a store
over a test's pool (the ``disk_pool`` fixture, ``conftest``), a block's digest, I/O settled."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xxhash

from torch_kv_tier.keys import Key, key_fingerprint
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


def digest_of(pool: np.ndarray, slot: int, key: Key) -> int:
    """The digest of ``pool``'s DRAM slot holding ``key``."""
    return xxhash.xxh3_64_intdigest(pool[slot], key_fingerprint(key))


def settle(store: DiskStore) -> DiskCompletions:
    """Poll until no I/O is in flight; every completion seen."""
    done = DiskCompletions()
    while store.in_flight():
        more = store.poll()
        done.written += more.written
        done.read += more.read
        done.failed += more.failed
    return done
