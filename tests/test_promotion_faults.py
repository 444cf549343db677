"""A shared host's promotion of a key from its disk (``serve --disk``) under faults: the disk's
I/O hanging mid-read while the key is stored again, the host frozen or killed while a tier's
load waits for the promotion, and a reader held between the promoted slot's announcement and
its read while a writer takes that slot. Each costs a miss or a late hit, never wrong bytes, a
slot handed out while the disk still writes it, a future left unsettled or a disk copy lost."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from disk_support import DISK_POOL, HungDevice, digest_of, open_store
from remote_support import BLOCK_LEN, fill_random, wait_until
from test_disk_host import RESULT_TIMEOUT_S, _serve, _stats, _store_all

from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager
from torch_kv_tier.records import Op
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote.disk_tier import DiskTier
from torch_kv_tier.remote.leases import SlotPool
from torch_kv_tier.remote.shared_cache import SharedCache
from torch_kv_tier.results import MISSING, PEER_LOST

KEYS = 96  # three times the host's DRAM pool (``test_disk_host.POOL_BLOCKS``)


def _step_until(tier: DiskTier, done: Callable[[], bool], what: str) -> None:
    """Step ``tier`` (polling its disk) until ``done``; fail the test after 10 s."""
    deadline = time.monotonic() + 10.0
    while not done():
        assert time.monotonic() < deadline, f"timed out after 10 s waiting until {what}"
        tier.step(time.monotonic())
        time.sleep(0.001)  # the device's requests are polled, not awaited: leave it the CPU


def test_a_failed_copy_of_a_key_being_promoted_leaves_the_read_its_dram_slot(
    disk_pool: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review, on real files: key a's promotion reading its old disk copy on a hung
    device, a stored again with other bytes (the old copy dropped), and the copy of the new
    bytes given up: that failed copy ended a's promotion, whose DRAM slot the next grant handed
    out while the hung read could still land in it. The slot stays granted until its read
    ends."""
    with closing(open_store(disk_pool, [tmp_path / "d"], 128)) as store:
        store.recover()
        cache = SharedCache(SlotPool(DISK_POOL), max_granted=DISK_POOL)
        tier = DiskTier(cache, store, admit_after=2)  # a key is copied once seen twice
        cache.join("s", "ns")
        ns = cache.namespace_of("s")

        def commit(keys: list[Key]) -> None:
            slots = cache.grant("s", len(keys))
            digests = [digest_of(disk_pool, s, k) for s, k in zip(slots, keys)]
            cache.commit("s", keys, slots, digests)

        commit([b"a"])
        cache.touch("s", [b"a"])  # seen twice: copied
        _step_until(tier, lambda: store.contains("ns", b"a") and not store.in_flight(), "copied")
        commit([f"k{i}".encode() for i in range(DISK_POOL)])  # seen once each: a left DRAM
        assert b"a" not in ns.entries
        hung = HungDevice(store, monkeypatch)
        tier.promote(ns, [b"a"], time.monotonic())
        tier.step(time.monotonic())  # the read of a's old copy posted, hung
        (reading,) = store.busy_dram_slots()
        commit([b"a"])  # other bytes: the old copy dropped
        assert not store.contains("ns", b"a")
        store.request_timeout_s = 0.05  # the copy of a's new bytes only
        _step_until(tier, lambda: store.stats()["disk_stuck"] == 1, "the copy is given up")
        assert store.busy_dram_slots() == {reading} and ns.granted == 1
        assert reading not in cache.grant("s", DISK_POOL)  # every other slot
        hung.resume()
        _step_until(tier, lambda: not store.in_flight(), "the read ended")
        assert tier.stats()["disk_promotions_failed"] == 1  # its copy dropped: old bytes
        cache.join("o", "ns")
        assert cache.grant("o", 1) == [reading]


def _on_disk(
    server: ServerProcess, writer: TierManager, reader: TierManager, n: int, timeout_s: float
) -> tuple[list[bytes], list[int], torch.Tensor]:
    """``KEYS`` keys stored by ``writer`` from its arena's blocks, each copied to the host's
    disk (most left its DRAM); ``reader`` connected, waiting ``timeout_s`` for promotions. The
    first ``n`` keys on the host's disk only, their blocks, and the writer's bytes."""
    keys = [f"promo-{i}".encode() for i in range(KEYS)]
    writer.connect(server.address)
    original = fill_random(writer)
    _store_all(writer, keys, server.address)
    reader.connect(server.address)
    reader.promotion_timeout_s = timeout_s
    blocks = [i for i, k in enumerate(keys) if not reader.contains(k)][:n]
    assert len(blocks) == n
    return [keys[i] for i in blocks], blocks, original


def test_a_host_frozen_while_a_load_waits_for_its_promotion_costs_a_miss_then_serves_the_bytes(
    tmp_path: Path,
) -> None:
    """SIGSTOP on the host while a load of keys on its disk waits: the load is missing at its
    promotion's deadline, nothing landed in its blocks; after SIGCONT the host promotes them and
    a load returns their bytes."""
    with (
        _serve(tmp_path / "disk") as server,
        TierManager.create(KEYS, BLOCK_LEN, name="writer") as writer,
        TierManager.create(KEYS, BLOCK_LEN, name="reader") as reader,
    ):
        cold, on_disk, original = _on_disk(server, writer, reader, 16, 1.0)
        reader.arena.tensor.zero_()
        server.proc.send_signal(signal.SIGSTOP)
        try:
            missed = reader.load(cold, on_disk).result(timeout=RESULT_TIMEOUT_S)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert missed.failed == dict.fromkeys(cold, MISSING)
        assert not reader.arena.tensor[on_disk].any()  # nothing read into the blocks
        wait_until(lambda: all(map(reader.contains, cold)), "the host promoted them", 20.0)
        loaded = reader.load(cold, on_disk).result(timeout=RESULT_TIMEOUT_S)
        assert loaded.ok, loaded.failed
        assert torch.equal(reader.arena.tensor[on_disk], original[on_disk])
        assert _stats(server.address)["disk_promotions_failed"] == 0


def test_a_host_killed_while_a_load_waits_for_its_promotion_settles_it_and_keeps_the_disk(
    tmp_path: Path,
) -> None:
    """SIGKILL on the (frozen) host while a load of keys on its disk waits: the load settles
    "peer lost" at once, not at its deadline; the host restarted on its disk serves them."""
    server = _serve(tmp_path / "disk")
    try:
        with (
            TierManager.create(KEYS, BLOCK_LEN, name="writer") as writer,
            TierManager.create(KEYS, BLOCK_LEN, name="reader") as reader,
        ):
            # settled by the host's loss only, never by its deadline
            cold, on_disk, original = _on_disk(server, writer, reader, 16, 10 * RESULT_TIMEOUT_S)
            server.proc.send_signal(signal.SIGSTOP)
            waiting = reader.load(cold, on_disk)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(timeout=10)
            lost = waiting.result(timeout=RESULT_TIMEOUT_S)
            assert lost.failed == dict.fromkeys(cold, PEER_LOST)
    finally:
        server.stop()
    with (
        _serve(tmp_path / "disk") as server,
        TierManager.create(KEYS, BLOCK_LEN, name="after") as after,
    ):
        assert _stats(server.address)["disk_keys"] == KEYS  # none lost
        after.connect(server.address)
        loaded = after.load(cold, on_disk).result(timeout=RESULT_TIMEOUT_S)
        assert loaded.ok, loaded.failed
        assert torch.equal(after.arena.tensor[on_disk], original[on_disk])


def test_a_promoted_slot_a_writer_took_before_a_held_reader_read_it_is_a_miss(
    tmp_path: Path,
) -> None:
    """A reader held (a hook) between the host's announcing the promoted slots and its read of
    them, while a writer's stores evict the promoted keys and write other bytes into every slot
    of the pool: the reads fail their digests, a miss, never the writer's bytes."""
    with (
        _serve(tmp_path / "disk") as server,
        TierManager.create(KEYS, BLOCK_LEN, name="writer") as writer,
        TierManager.create(KEYS, BLOCK_LEN, name="reader") as reader,
    ):
        cold, on_disk, _ = _on_disk(server, writer, reader, 4, RESULT_TIMEOUT_S)
        held, go = threading.Event(), threading.Event()
        launch = reader._launch

        def held_launch(op: Op) -> None:  # the promoted keys' reads, once announced
            if op.kind == "load" and not go.is_set():
                held.set()
                assert go.wait(RESULT_TIMEOUT_S), "the test never let the read go"
            launch(op)

        reader._launch = held_launch  # type: ignore[method-assign]
        waiting = reader.load(cold, on_disk)
        assert held.wait(RESULT_TIMEOUT_S), "the promoted keys were never read"
        for i in range(0, 128, 8):  # four times the pool: every promoted slot written again
            fill_random(writer)
            batch = [f"over-{j}".encode() for j in range(i, i + 8)]
            stored = writer.store(batch, range(8)).result(timeout=RESULT_TIMEOUT_S)
            assert stored.ok, stored.failed
        go.set()
        loaded = waiting.result(timeout=RESULT_TIMEOUT_S)
        assert loaded.failed == dict.fromkeys(cold, MISSING)
        assert 1 <= reader.stats().verify_failed <= len(cold)  # the rest known gone, unread
