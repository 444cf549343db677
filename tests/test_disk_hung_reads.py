"""A disk read given up on a hung device (a stuck NFS mount, a multipath failover; found by
review): it costs misses while the device hangs, never the block it was reading. Its key stays
on disk, in the journal and across a restart, and is read once the device answers; a read that
then ends failed drops it, as any failed read does."""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from disk_support import HungDevice, digest_of, open_store, poll_until, run_script, settle

from torch_kv_tier.remote.disk_frames import DEL, parse
from torch_kv_tier.remote.disk_store import DiskStore


def _journaled_dels(d: Path) -> list[bytes]:
    """The keys of the ``DEL`` records in directory ``d``'s journal."""
    generation = json.loads((d / "meta.json").read_text())["generation"]
    records = parse((d / "journal.log").read_bytes(), generation=generation).records
    return [r[3] for r in records if r[0] == DEL]


def _stuck_read(store: DiskStore, hung: HungDevice, key: bytes, dram: int) -> None:
    """Read ``key`` into ``dram`` on the hung device and poll until it is given up."""
    store.request_timeout_s = 0.2  # this request's deadline only
    store.read([("ns", key, dram)])
    store.request_timeout_s = 30.0
    got = poll_until(store, "abandoned")
    assert got["abandoned"] == [("ns", key, dram)] and not got["read"] and not got["failed"]
    assert len(hung.held) == 1


def test_a_read_given_up_on_a_hung_device_keeps_its_key_on_disk_and_across_a_restart(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read not done within ``request_timeout_s`` dropped its keys and journaled their
    ``DEL``, though their blocks were intact: a device frozen for a minute lost the only copy
    of every key read meanwhile, for good. Its keys now stay (no ``DEL``), read once the device
    answers, and a restart finds them."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        store.write([("ns", b"K", digest_of(disk_pool, 0, b"K"), 0)])
        assert settle(store).written == [("ns", b"K")]
        hung = HungDevice(store, monkeypatch)
        _stuck_read(store, hung, b"K", 30)
        assert store.contains("ns", b"K") and store.busy_dram_slots() == {30}
        assert store.hung("ns", b"K")  # a promotion of it takes no DRAM slot (``DiskTier``)
        assert store.read([("ns", b"K", 31)]) == []  # the directory is stuck: refused at once
        assert store.poll().failed == [("ns", b"K", 31)] and store.contains("ns", b"K")
        hung.resume()  # the device answers
        assert poll_until(store, "released")["released"] == [30]
        assert not store.hung("ns", b"K")
        hung.hangs = False
        disk_pool[32] = 0
        assert store.read([("ns", b"K", 32)]) == []
        assert [(k, dram) for _, k, dram, _ in settle(store).read] == [(b"K", 32)]
        assert np.array_equal(disk_pool[32], disk_pool[0])
        assert store.sync(10.0)
    assert _journaled_dels(d) == []
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert [k for _, k, _ in store.recover()] == [b"K"]  # its block verifies


def test_a_read_given_up_that_then_fails_drops_its_key_once(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block whose read hangs the device and then fails (a bad sector's retries) would hang
    the directory at every read of it, were its key kept: it is dropped (a ``DEL``) as the
    read ends failed, as a read failed in time drops its key; the other keys stay."""
    d = tmp_path / "d"
    with closing(open_store(disk_pool, [d], 8)) as store:
        store.recover()
        items = [("ns", k, digest_of(disk_pool, i, k), i) for i, k in enumerate([b"K", b"M"])]
        store.write(items)
        assert len(settle(store).written) == 2
        hung = HungDevice(store, monkeypatch)
        _stuck_read(store, hung, b"K", 30)
        assert store.contains("ns", b"K")
        monkeypatch.setattr(store._io, "state", lambda handle, kind, f: "ERR")  # ends failed
        assert poll_until(store, "released")["released"] == [30]
        assert not store.contains("ns", b"K") and store.contains("ns", b"M")
        hung.held = []  # never started: nothing to resume
        assert store.sync(10.0)
    assert _journaled_dels(d) == [b"K"]
    with closing(open_store(disk_pool, [d], 8)) as store:
        assert [k for _, k, _ in store.recover()] == [b"M"]


def test_a_hung_directory_refuses_only_the_keys_it_holds(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hung`` maps a key to its directory as the slots do (global slot ``g`` in directory
    ``g % n``): with a read given up in the second of three directories, only that directory's
    keys are hung, and the other directories' keys are read meanwhile."""
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    with closing(open_store(disk_pool, dirs, 4)) as store:
        store.recover()
        keys = [b"k%d" % i for i in range(9)]
        store.write([("ns", k, digest_of(disk_pool, i, k), i) for i, k in enumerate(keys)])
        assert len(settle(store).written) == 9
        in_second = {k for k in keys if store._index.where[("ns", k)][0] % 3 == 1}
        assert len(in_second) == 3
        hung = HungDevice(store, monkeypatch)
        _stuck_read(store, hung, sorted(in_second)[0], 30)
        assert {k for k in keys if store.hung("ns", k)} == in_second
        hung.hangs = False
        others = [k for k in keys if k not in in_second]
        store.read([("ns", k, 40 + i) for i, k in enumerate(others)])
        assert len(settle(store).read) == 6  # (the read given up is not in flight for settle)
        hung.resume()
        assert poll_until(store, "released")["released"] == [30]


_EXITS_WHILE_HUNG = """
import sys
from pathlib import Path
from disk_support import digest_of, make_disk_pool, open_store, poll_until, settle
from torch_kv_tier.remote import disk_store

disk_store.CLOSE_WAIT_S = 0.2
pool = make_disk_pool()
store = open_store(pool, [Path(sys.argv[1])], 8)
store.recover()
store.write([("ns", b"K", digest_of(pool, 0, b"K"), 0)])
settle(store)
store._io.state = lambda handle, kind, f: "PROC"  # the device stops answering
store.request_timeout_s = 0.2
store.read([("ns", b"K", 3)])
poll_until(store, "abandoned")
store.close()
"""


def test_a_host_that_exits_while_a_read_hangs_finds_its_key_at_restart(
    disk_pool: np.ndarray, tmp_path: Path
) -> None:
    """A host stopped while a read given up still hangs (its store closed, what the read uses
    kept until the process exits) journals no ``DEL``: the restarted host finds the key, its
    block verified."""
    proc = run_script(_EXITS_WHILE_HUNG, tmp_path / "d")
    assert "given up" in proc.stderr and "1 requests still in flight" in proc.stderr
    assert _journaled_dels(tmp_path / "d") == []
    with closing(open_store(disk_pool, [tmp_path / "d"], 8)) as store:
        assert [k for _, k, _ in store.recover()] == [b"K"]
