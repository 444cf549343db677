"""A disk whose writes fail in part (found by review): one ``--disk`` directory of several dead
or read-only. The directories that still take writes keep taking copies, the failing one loses
no key it holds, and a write done there ends its failing."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import digest_of, open_store, settle

from torch_kv_tier.remote import disk_index
from torch_kv_tier.remote.disk_io import DiskTransfers
from torch_kv_tier.remote.disk_store import DiskCompletions, DiskStore


def _fail_writes(monkeypatch: pytest.MonkeyPatch, fails: Callable[[int, list[int]], bool]) -> None:
    """Writes to directory ``f`` at its slots ``disk`` fail to start where ``fails(f, disk)``."""
    real_post = DiskTransfers.post

    def post(self: DiskTransfers, kind: str, f: int, dram: list[int], disk: list[int]) -> Any:
        if kind == "write" and fails(f, disk):
            self._failed(kind, f, f"a {kind} of {len(dram)} blocks could not start: injected EIO")
            return None, "ERR"
        return real_post(self, kind, f, dram, disk)

    monkeypatch.setattr(DiskTransfers, "post", post)


def _copy(store: DiskStore, pool: np.ndarray, keys: list[bytes], first: int) -> DiskCompletions:
    """Write ``keys`` from DRAM slots ``first``... and collect every completion."""
    store.write([("ns", k, digest_of(pool, first + i, k), first + i) for i, k in enumerate(keys)])
    done = settle(store)
    done.failed += store.poll().failed  # those refused at once come with the next poll
    return done


def _keys_of(store: DiskStore, f: int) -> set[Any]:
    """The keys directory ``f`` of two holds."""
    return {pair for pair in store.slot_owners().pairs[f::2] if pair is not None}


def test_one_failing_directory_of_two_stops_no_copy_to_the_other(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write to directory a failed (a dead device): its free slots were the only ones a
    write could take while the last write failed, so every copy went to a and failed, and b,
    healthy, took none again (0 of 80 copies). b now takes the copies, evicting its own keys;
    a's keys are kept, and a is probed; one write done there ends its failing."""
    monkeypatch.setattr(disk_index, "WRITE_PROBE_S", 0.0)  # a probe at every write
    dirs = [tmp_path / "a", tmp_path / "b"]
    with closing(open_store(disk_pool, dirs, 4)) as store:
        store.recover()
        assert len(_copy(store, disk_pool, [f"k{i}".encode() for i in range(8)], 0).written) == 8
        a_dead = True
        _fail_writes(monkeypatch, lambda f, disk: a_dead and f == 0)
        for r in range(2):  # 8 keys evicted: a write to a (which LRU keys are a's varies)
            _copy(store, disk_pool, [f"f{r}-{i}".encode() for i in range(4)], 8)
        assert store.stats()["disk_writes_failing"] == 1
        held_in_a = _keys_of(store, 0)
        written = []
        for r in range(20):
            done = _copy(store, disk_pool, [f"n{r}-{i}".encode() for i in range(4)], 8 + r)
            written += done.written
        assert len(written) >= 50 and store.stats()["disk_writes_failing"] == 1
        assert _keys_of(store, 0) == held_in_a  # none evicted for writes that failed
        a_dead = False
        done = _copy(store, disk_pool, [b"healed"], 40)
        assert ("ns", b"healed") in done.written and store.stats()["disk_writes_failing"] == 0
        done = _copy(store, disk_pool, [f"m{i}".encode() for i in range(8)], 41)
        assert len(done.written) == 8 and len(_keys_of(store, 0)) == 4  # a written again
