"""A restore's read that the tier settled "timed out" (past ``transfer_timeout_s``) leaves its
arena blocks withheld until the transport reports the read (``TierManager.load``): the torch
loop's arena keeps those slots out until the tier says so (``withheld_until``), so later
offloads and restores never get slots the tier refuses. On a scripted tier, then on a host over
UCX's TCP transport frozen past a short ``transfer_timeout_s``."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future

import pytest
import torch
from arena_support import (
    WAIT_S,
    CtrlCAsItsCallbacksRun,
    ScriptedTier,
    batches,
    failures,
    stored,
)
from remote_support import wait_for
from test_transfer_timeout import start_bound
from torch_loop_support import BLOCK_LEN, random_caches, restored_exactly, stored_pages

from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader
from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.results import NO_PEERS, TIMED_OUT, TransferResult


def timed_out(keys: list[Key]) -> TransferResult:
    failed = dict.fromkeys(keys, TIMED_OUT)
    return TransferResult(ok=False, keys=[], failed=failed, nbytes=0, seconds=0.0)


class WithholdingTier(ScriptedTier):
    """A scripted tier whose loads' reads are settled "timed out" when the test says (``read``)
    and whose blocks stay withheld until it says (``gate``), refusing stores from them as
    ``TierManager.store`` does."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots, ["a"], frozen=set())
        self.read: Future[TransferResult] = Future()
        self.withheld: set[int] = set()
        self.gate: Future[TransferResult] = Future()
        self.gates.append(self.gate)
        self.gate.add_done_callback(lambda _: self.withheld.clear())

    def load(
        self, keys: list[Key], slots: list[int], begun: list[Future[TransferResult]] | None = None
    ) -> Future[TransferResult]:
        self.withheld.update(slots)
        return self.read

    def store(
        self, keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        if self.withheld.intersection(slots):
            raise ValueError(f"local blocks {sorted(self.withheld)} are still the target of a read")
        return super().store(keys, slots, placed)


def test_a_read_timed_out_as_its_restore_waited_keeps_its_slots_until_the_tier_lets_go() -> None:
    # Found by review: the restore freed the slots of a read the tier had settled "timed out"
    # while the tier still withheld them; the next offload took them and every page of it
    # failed with "tier refused a store" until the transport reported the read.
    tier = WithholdingTier(4)
    tier.read.set_result(timed_out([b"k", b"l"]))  # settled by the tier before the wait ends
    arena = batches(tier, timeout=WAIT_S)
    assert arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + WAIT_S) == 0
    assert tier.arena.num_free == 2
    offload = arena.store_all({b"m": 0, b"n": 1}, time.monotonic() + WAIT_S)
    assert [f.result(timeout=WAIT_S).failed for _, f in offload] == [{}]
    assert tier.arena.num_free == 2  # the store's slots are back, the read's still out
    tier.gate.set_result(stored([]))  # the transport reported the read
    assert tier.arena.num_free == 4
    offload = arena.store_all({b"o": 0, b"p": 1, b"q": 2, b"r": 3}, time.monotonic() + WAIT_S)
    assert [f.result(timeout=WAIT_S).failed for _, f in offload] == [{}]


def test_a_read_timed_out_after_its_restore_gave_up_keeps_its_slots_until_the_tier_lets_go() -> (
    None
):
    tier = WithholdingTier(4)
    arena = batches(tier, timeout=0.05)  # the restore gives up on the read under way
    assert arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + 0.05) == 0
    assert tier.arena.num_free == 2
    tier.read.set_result(timed_out([b"k", b"l"]))  # the tier settles it, withheld still
    assert tier.arena.num_free == 2
    offload = arena.store_all({b"m": 0, b"n": 1}, time.monotonic() + WAIT_S)
    assert [f.result(timeout=WAIT_S).failed for _, f in offload] == [{}]
    tier.gate.set_result(stored([]))
    assert tier.arena.num_free == 4


def test_a_timed_out_read_whose_callback_a_ctrl_c_stopped_keeps_its_slots_too() -> None:
    # The tier settled the read on this thread, a Ctrl-C landing before its callback ran: the
    # next batch's look at every record found it, and must withhold its slots as the callback.
    tier = WithholdingTier(4)
    tier.read = CtrlCAsItsCallbacksRun()
    arena = batches(tier, timeout=0.05)
    assert arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + 0.05) == 0
    with pytest.raises(KeyboardInterrupt):
        tier.read.set_result(timed_out([b"k", b"l"]))
    arena.interrupted()  # as the offloader does when a Ctrl-C comes out of the tier's call
    offload = arena.store_all({b"m": 0, b"n": 1}, time.monotonic() + WAIT_S)
    assert [f.result(timeout=WAIT_S).failed for _, f in offload] == [{}]
    assert tier.arena.num_free == 2
    tier.gate.set_result(stored([]))
    assert tier.arena.num_free == 4


def test_an_offload_that_finds_only_withheld_slots_fails_at_once_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = WithholdingTier(2)
    tier.read.set_result(timed_out([b"k", b"l"]))
    arena = batches(tier, timeout=WAIT_S)
    assert arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + WAIT_S) == 0
    started = time.monotonic()
    assert failures(arena.store_all({b"m": 0}, started + WAIT_S)) == {b"m": "capacity"}
    assert time.monotonic() - started < WAIT_S  # (no wait for slots that cannot come in time)
    assert "2 of reads that timed out, until their hosts report them" in caplog.text


def test_a_frozen_hosts_read_past_transfer_timeout_s_costs_no_later_page_its_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The user's tier (settles late loads, as TierManager does by default) under an offloader:
    # a restore's read from a host frozen past transfer_timeout_s (0.3 s here) settled "timed
    # out", its slots went back to the arena though the tier withheld them, and the offloads
    # that took them failed "local blocks [...] are still the target of a read" until the host
    # resumed.
    monkeypatch.setenv("UCX_TLS", "tcp")  # a stopped host's reads stay on the wire
    keys_c, values_c = random_caches(torch.float32, seed=31)
    keys = [f"withheld-{i}".encode() for i in range(6)]
    with ServerProcess.start(64, BLOCK_LEN, host="127.0.0.1", env={"UCX_TLS": "tcp"}) as server:
        tier = TierManager.create(4, BLOCK_LEN, transfer_timeout_s=0)  # (on while frozen only)
        with PagedKVOffloader(keys_c, values_c, tier, owns_manager=True, timeout=5.0) as off:
            off.connect(server.address)  # (a refused first dial is dialled again)
            assert wait_for(lambda: len(tier.peers()) == 1, 30.0)
            assert off.offload(range(2), keys[:2]).result(timeout=30).ok
            expected = stored_pages(off, keys)  # (pages 0.. under keys 0..)
            stop_process(server.proc.pid)
            start_bound(tier)  # (from now: a busy box's earlier transfers are not past it)
            try:
                assert off.restore(keys[:2], [10, 11]) == 0  # its read timed out: recompute
                assert tier.stats().late_reads == 1
                while_frozen = off.offload(range(2, 6), keys[2:6]).result(timeout=30)
                assert set(while_frozen.failed.values()) == {NO_PEERS}  # dropped: true reason
                assert tier.arena.num_free == 2  # the read's slots stay out
                assert off.restore(keys[:2], [10, 11]) == 0
            finally:
                tier._overdue.timeout_s = 0  # (no healthy transfer of the busy box is past it)
                os.kill(server.proc.pid, signal.SIGCONT)
            assert wait_for(lambda: tier.arena.num_free == 4 and len(tier.peers()) == 1, 30.0)
            assert off.offload(range(2, 6), keys[2:6]).result(timeout=30).ok
            on_host = [k for k in keys if tier.contains(k)]  # (2.. at least: just stored)
            assert set(keys[2:6]) <= set(on_host)
            for at in range(0, len(on_host), 4):  # arena-sized restores, as the loop makes
                part, dst = on_host[at : at + 4], list(range(12 + at, 12 + at + 4))
                assert off.restore(part, dst[: len(part)]) == len(part)
                assert restored_exactly(off, expected, part, dst)
