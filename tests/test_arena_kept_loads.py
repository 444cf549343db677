"""A restore that a Ctrl-C (``KeyboardInterrupt``) stopped inside the tier's load keeps that
load's arena slots out only until its reads end (``TierManager.load``'s ``begun``): never while
a read may land, and not for good. On a scripted tier, then on a real one with a host."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
import types
from concurrent.futures import Future

import pytest
import torch
from arena_support import WAIT_S, ScriptedTier, batches, ctrl_c_at_line, failures, stored
from remote_support import wait_for
from test_transfer_timeout import start_bound
from test_withheld_slots import timed_out
from torch_loop_support import (
    BLOCK_LEN,
    module_host,
    random_caches,
    restored_exactly,
    stored_pages,
)

from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader, prefix_keys
from torch_kv_tier.integrations.torch_loop.arena_heal import ArenaHeal
from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.results import TransferResult

remote = module_host()


class BegunThenCtrlC(ScriptedTier):
    """A tier whose first load begins its read (``read``, under way until the test ends it),
    then a Ctrl-C lands inside it, before it returned the future; ``began`` False: it lands
    before the load began anything. Later loads are ``ScriptedTier``'s."""

    def __init__(self, began: bool = True) -> None:
        super().__init__(4, ["a"], frozen=set())
        self.began = began
        self.read: Future[TransferResult] = Future()
        self.sent: list[int] = []  # the slots the read may write
        self.interrupted = False

    def load(
        self, keys: list[Key], slots: list[int], begun: list[Future[TransferResult]] | None = None
    ) -> Future[TransferResult]:
        if self.interrupted:  # once only
            return super().load(keys, slots, begun)
        self.interrupted = True
        if self.began and begun is not None:
            begun.append(self.read)
            self.sent = list(slots)
        raise KeyboardInterrupt


@pytest.mark.parametrize("outcome", ["ok", "timed out"])
def test_a_load_a_ctrl_c_stopped_in_the_tier_keeps_its_slots_until_its_reads_end(
    outcome: str,
) -> None:
    # Found by review: a restore that a Ctrl-C stopped inside the tier's load, once it had
    # begun the read, kept that batch's arena slots for good (nothing said when the read
    # ended): a loop that handles an occasional Ctrl-C lost slots one batch at a time until
    # every offload failed "capacity". The tier hands the load's future out as the load
    # begins now: the slots stay out while the read may land, and come back once it ended
    # (a failed read's once the tier no longer withholds them).
    tier = BegunThenCtrlC()
    arena = batches(tier, timeout=WAIT_S)
    with pytest.raises(KeyboardInterrupt):
        arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + WAIT_S)
    assert failures(arena.store_all({b"m": 2, b"n": 3}, time.monotonic() + WAIT_S)) == {}
    assert not any(map(tier.arena.is_free, tier.sent)), "slots a read may write are free"
    assert tier.arena.num_free == 2
    gate: Future[TransferResult] = Future()
    tier.gates.append(gate)  # the tier withholds a timed-out read's slots until it says
    tier.read.set_result(stored([b"k", b"l"]) if outcome == "ok" else timed_out([b"k", b"l"]))
    if outcome != "ok":
        assert tier.arena.num_free == 2, "slots the tier withholds are free"
        gate.set_result(stored([]))
    assert tier.arena.num_free == 4
    assert arena.load_prefix([b"m", b"n"], [0, 1], time.monotonic() + WAIT_S) == 2


def test_a_load_a_ctrl_c_stopped_before_it_began_gives_its_slots_back_at_the_next_batch() -> None:
    # Before, its slots were kept for good as if the read had begun.
    tier = BegunThenCtrlC(began=False)
    arena = batches(tier, timeout=WAIT_S)
    with pytest.raises(KeyboardInterrupt):
        arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + WAIT_S)
    assert failures(arena.store_all({b"m": 2}, time.monotonic() + WAIT_S)) == {}  # (heals)
    assert tier.arena.num_free == 4


def test_a_restore_a_ctrl_c_stopped_in_the_tiers_load_gets_its_slots_back(remote: str) -> None:
    # The same with a real tier and host: a Ctrl-C in TierManager.load once it had sent the
    # read (as it polls what it sent). Before, the restore's 2 slots stayed out for good.
    keys_c, values_c = random_caches(torch.float32, seed=23)
    manager = TierManager.create(
        num_blocks=4, block_len=BLOCK_LEN, name="kept-load", config_fields={"t": "kept-load"}
    )
    keys = prefix_keys(range(16), 8, namespace=b"kept-load")
    with PagedKVOffloader(keys_c, values_c, manager, owns_manager=True) as off:
        assert off.connect(remote)
        assert off.offload([0, 1], keys).result(timeout=30).ok
        where: dict[types.CodeType, set[int] | None] = {TierManager.load.__code__: None}
        with (
            ctrl_c_at_line(where, "self._submitted(request, peer_ids)") as seen,
            contextlib.suppress(KeyboardInterrupt),
        ):
            off.restore(keys, [2, 3])
        assert "self._submitted(request, peer_ids)" in seen[-1]
        assert off.lookup(keys) == 2 and off.restore(keys, [4, 5]) == 2  # (heals first)
        assert wait_for(lambda: manager.arena.num_free == 4, 30.0)
        assert torch.equal(keys_c[0][4], keys_c[0][0]) and torch.equal(
            values_c[1][5], values_c[1][1]
        )


def test_a_heal_interrupted_after_it_kept_a_loads_slots_frees_them_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A Ctrl-C as the next batch's heal had kept the load's slots leaves the heal to the batch
    # after, which keeps them again: once the read ended they come back once, not once per
    # keep (a second free: ``ValueError``, or slots freed under a later batch).
    tier = BegunThenCtrlC()
    arena = batches(tier, timeout=WAIT_S)
    with pytest.raises(KeyboardInterrupt):
        arena.load_prefix([b"k", b"l"], [0, 1], time.monotonic() + WAIT_S)
    where: dict[types.CodeType, set[int] | None] = {ArenaHeal._heal.__code__: None}
    with ctrl_c_at_line(where, "self._calling = None") as seen, pytest.raises(KeyboardInterrupt):
        arena.store_all({b"m": 2}, time.monotonic() + WAIT_S)
    assert "self._calling = None" in seen[-1]
    assert failures(arena.store_all({b"n": 3}, time.monotonic() + WAIT_S)) == {}  # (heals)
    assert tier.arena.num_free == 2
    tier.read.set_result(stored([b"k", b"l"]))
    assert tier.arena.num_free == 4
    assert arena.store_all({b"o": 0, b"p": 1, b"q": 2, b"r": 3}, time.monotonic() + WAIT_S)
    assert tier.arena.num_free == 4
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # none freed twice


class ResolvesTheReadInAStore(BegunThenCtrlC):
    """``BegunThenCtrlC`` whose interrupted load's read the tier resolves (``outcome``) inside
    a later store once ``armed``, on the caller's thread, as a store resolves the futures the
    poller settled meanwhile; it withholds the read's slots until ``gate`` resolves (each ask
    of ``withheld_until`` meanwhile gets a future pending until then)."""

    def __init__(self, outcome: TransferResult | Exception) -> None:
        super().__init__()
        self.outcome = outcome
        self.armed = False
        self.gate: Future[TransferResult] = Future()

    def store(
        self, keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        future = super().store(keys, slots, placed)
        if self.armed:
            self.armed = False
            if isinstance(self.outcome, Exception):
                self.read.set_exception(self.outcome)
            else:
                self.read.set_result(self.outcome)
        return future

    def withheld_until(self, slots: list[int]) -> Future[TransferResult]:
        until: Future[TransferResult] = Future()
        self.gate.add_done_callback(lambda _: until.set_result(stored([])))
        return until


@pytest.mark.parametrize("outcome", ["ok", "timed out", "raised"])
def test_a_ctrl_c_as_a_kept_loads_slots_come_back_frees_none_a_read_may_write_nor_keeps_any(
    outcome: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by review (a KeyboardInterrupt injected at every line of ``_unkeep``, which runs on
    # the caller's thread when the kept load's future resolves in a tier's call there): one
    # before it took the slots kept them for good, the read long ended; one after it took a
    # timed-out read's slots before it withheld them had the next batch's heal free them while
    # the tier still withheld them (a late read may land there: later batches that took them
    # were refused); one after it withheld them before it asked the tier withheld them for
    # good. A failed read's slots stay kept now, for the tier's word, and the next batch makes
    # again an ``_unkeep`` that a Ctrl-C stopped. A future that raised (the tier's do not)
    # raised in ``_unkeep`` too, its slots kept for good: it counts as a failed read's now.
    where: dict[types.CodeType, set[int] | None] = {ArenaHeal._unkeep.__code__: None}
    for k in itertools.count(1):
        keys = [b"k", b"l"]
        ends = {"ok": stored(keys), "timed out": timed_out(keys), "raised": RuntimeError("x")}
        tier = ResolvesTheReadInAStore(ends[outcome])
        arena = batches(tier, timeout=WAIT_S)
        with pytest.raises(KeyboardInterrupt):
            arena.load_prefix(keys, [0, 1], time.monotonic() + WAIT_S)
        assert failures(arena.store_all({b"m": 2}, time.monotonic() + WAIT_S)) == {}  # keeps
        tier.armed = True
        with ctrl_c_at_line(where, k) as seen, contextlib.suppress(KeyboardInterrupt):
            arena.store_all({b"n": 3}, time.monotonic() + WAIT_S)
        at = repr(seen[-1])
        for page in (2, 3):  # (the next batches heal)
            assert failures(arena.store_all({b"o": page}, time.monotonic() + WAIT_S)) == {}
        if outcome != "ok":
            assert not any(map(tier.arena.is_free, tier.sent)), f"Ctrl-C at {at} freed them"
            tier.gate.set_result(stored([]))
        assert failures(arena.store_all({b"p": 2}, time.monotonic() + WAIT_S)) == {}
        assert tier.arena.num_free == 4, f"Ctrl-C at {at} kept slots for good"
        assert not [r for r in caplog.records if r.levelname == "ERROR"], at  # freed twice
        if len(seen) < k:  # it ran through: every line was hit once
            break
    assert k > 5


def test_a_frozen_hosts_read_a_ctrl_c_stopped_in_the_tier_keeps_its_slots_till_it_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Reviewed: over UCX's TCP transport from a stopped host (SIGSTOP), the read of a restore
    # that a Ctrl-C stopped in the tier's load stays on the wire; the tier settles it "timed
    # out" past transfer_timeout_s, and its slots stay out until the transport reports it
    # (the host resumed), then come back; the pages restore exactly.
    monkeypatch.setenv("UCX_TLS", "tcp")  # a stopped host's reads stay on the wire
    keys_c, values_c = random_caches(torch.float32, seed=41)
    keys = [f"kept-frozen-{i}".encode() for i in range(2)]
    where: dict[types.CodeType, set[int] | None] = {TierManager.load.__code__: None}
    with ServerProcess.start(64, BLOCK_LEN, host="127.0.0.1", env={"UCX_TLS": "tcp"}) as server:
        tier = TierManager.create(4, BLOCK_LEN, transfer_timeout_s=0)  # (on while frozen only)
        with PagedKVOffloader(keys_c, values_c, tier, owns_manager=True, timeout=5.0) as off:
            off.connect(server.address)  # (a refused first dial is dialled again)
            assert wait_for(lambda: len(tier.peers()) == 1, 30.0)
            assert off.offload([0, 1], keys).result(timeout=30).ok
            expected = stored_pages(off, keys)
            stop_process(server.proc.pid)
            try:
                with (
                    ctrl_c_at_line(where, "self._submitted(request, peer_ids)") as seen,
                    contextlib.suppress(KeyboardInterrupt),
                ):
                    off.restore(keys, [2, 3])
                assert "self._submitted(request, peer_ids)" in seen[-1]
                assert off.offload([0], keys[:1]).result(timeout=30).ok  # (heals: stored)
                start_bound(tier)
                assert wait_for(lambda: tier.stats().late_reads == 1, 30.0)  # timed out
                off.offload([0], keys[:1]).result(timeout=30)  # (fails "no peers": dropped)
                assert tier.arena.num_free == 2, "slots the late read may write are free"
            finally:
                tier._overdue.timeout_s = 0  # (no healthy transfer of the busy box is past it)
                os.kill(server.proc.pid, signal.SIGCONT)
            assert wait_for(lambda: tier.arena.num_free == 4 and len(tier.peers()) == 1, 30.0)
            assert off.restore(keys, [12, 13]) == 2
            assert restored_exactly(off, expected, keys, [12, 13])
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # none freed twice
