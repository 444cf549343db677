"""The manager's failure model over an in-process transport whose writes land when the test
says so (``late_write_support``, no NIXL needed): late and failed writes never corrupt or
hand on a slot, faulted peers are dropped, ``close`` and futures under writes in flight."""

from __future__ import annotations

import threading

import pytest
import torch
from late_write_support import BLOCK, LateWriteTransport, late_write_tier
from remote_support import wait_until

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.keys import home_peer
from torch_kv_tier.manager import TierManager


def test_a_late_write_of_a_dropped_registration_cannot_corrupt_the_new_one() -> None:
    arena = BlockArena(16, BLOCK)
    arena.tensor.copy_(torch.arange(16, dtype=torch.uint8).unsqueeze(1).expand(16, BLOCK))
    with late_write_tier(arena, {"p": 4}, events=True) as (tier, transport):
        transport.hold = True
        old = tier.store(["a", "b"], [0, 1])  # stays in flight
        transport.fault("p", "state check raised")  # the write may still land
        result = old.result(timeout=5)  # the future does not wait for the write
        assert result.failed == {"a": "peer lost", "b": "peer lost"}
        assert tier.peers() == [] and tier.stats().inflight == 1
        (late,) = transport.in_flight()

        transport.hold = False
        tier.add_peer("p", b"p", 0, 4, BLOCK)  # the same memory under the same peer id
        new = tier.store(["c", "d", "e", "f"], [2, 3, 4, 5]).result(timeout=5)
        assert new.failed == {"e": "capacity", "f": "capacity"}  # 2 slots wait for the write
        transport.land(late)  # the old write lands now, where it was aimed
        assert tier.load(["c", "d"], [8, 9]).result(timeout=5).ok
        assert torch.equal(arena.tensor[8:10], arena.tensor[2:4])  # not overwritten

        # reported: its slots return to the pool
        wait_until(lambda: tier.stats().inflight == 0, "the late write is reported")
        assert tier.store(["e", "f"], [4, 5]).result(timeout=5).ok
        assert tier.load(["c", "d", "e", "f"], [8, 9, 10, 11]).result(timeout=5).ok
        assert torch.equal(arena.tensor[8:12], arena.tensor[2:6])
        lost = [e.key for e in tier.take_events() if e.kind == "lost"]
        assert lost == []  # "a" and "b" never became visible


@pytest.mark.parametrize("failed_by", ["its post", "its report"])
def test_a_failed_write_never_hands_its_slot_to_another_key(failed_by: str) -> None:
    """A write that failed may still land part-way (NIXL reports a failure while other parts are
    in flight; a post that fails part-way frees what it sent): its slot used to go back to the
    pool, a private tier without verification stored another key there, the stray write landed
    and that key loaded the first one's bytes as ok."""
    arena = BlockArena(4, BLOCK)
    arena.tensor[0].fill_(0xAA)
    arena.tensor[1].fill_(0xBB)
    with late_write_tier(arena, {"p": 1}, verify=False) as (tier, transport):
        transport.hold = failed_by == "its report"
        transport.refuse_next = failed_by == "its post"
        first = tier.store(["a"], [0])
        (stray,) = transport.in_flight()
        if failed_by == "its report":
            transport.fail(stray)
        assert first.result(timeout=5).failed == {"a": "transfer failed"}
        assert tier.peers() == []
        transport.hold = False
        tier.add_peer("p", b"p", 0, 1, BLOCK)  # the same memory under the same peer id
        assert tier.store(["b"], [1]).result(timeout=5).failed == {"b": "capacity"}
        transport.land(stray)
        assert tier.lookup(["b"]) == 0
        stats = tier.stats()
        assert stats.inflight == 0
        assert stats.transfers_failed == 1  # a refused post too: it failed its keys alike


def test_a_write_of_a_dropped_registration_reported_failed_stays_fenced() -> None:
    """The transport reported a write of a dropped registration failed: its slot came back to
    the pool as if the write had ended, while part of it may still land."""
    arena = BlockArena(4, BLOCK)
    with late_write_tier(arena, {"p": 1}) as (tier, transport):
        transport.hold = True
        assert tier.store(["a"], [0]).done() is False
        transport.fault("p", "state check raised")
        wait_until(lambda: tier.peers() == [], "p is dropped")  # its write stays in flight
        (stray,) = transport.in_flight()
        tier.add_peer("p", b"p", 0, 1, BLOCK)
        transport.fail(stray)
        wait_until(lambda: tier.stats().inflight == 0, "the failed write is reported")
        transport.hold = False
        assert tier.store(["b"], [1]).result(timeout=5).failed == {"b": "capacity"}


def test_a_faulted_peer_is_dropped_with_its_keys() -> None:
    arena = BlockArena(32, BLOCK)
    with late_write_tier(arena, {"h1": 8, "h2": 8}, events=True) as (tier, transport):
        keys = [f"k{i}" for i in range(8)]
        assert tier.store(keys, list(range(8))).result(timeout=5).ok
        transport.fault("h1", "repeated transfer failures")
        on_h1 = [k for k in keys if home_peer(k, ["h1", "h2"]) == "h1"]
        assert on_h1 and len(on_h1) < 8
        tier.load(on_h1, list(range(20, 20 + len(on_h1)))).result(timeout=5)  # polls h1
        assert tier.peers() == ["h2"]
        assert {e.key for e in tier.take_events() if e.kind == "lost"} == set(on_h1)
        assert tier.lookup(on_h1) == 0
    with pytest.raises(RuntimeError, match="closed"):
        tier.store(["x"], [0])


def test_close_does_not_wait_for_a_write_orphaned_by_a_dropped_peer() -> None:
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        transport.hold = True
        pending = tier.store(["a"], [0])
        transport.fault("p", "state check raised")
        assert pending.result(timeout=5).failed == {"a": "peer lost"}
        closer = threading.Thread(target=tier.close, kwargs={"timeout": 60.0})
        closer.start()
        closer.join(timeout=20)  # its future is resolved: close() must not sit out its timeout
        assert not closer.is_alive()
        assert transport.in_flight() == []  # the orphaned write was cancelled


def test_close_from_a_done_callback_still_sees_the_transfers_in_flight_finish() -> None:
    """``close`` called by a future's callback runs on the poller thread and waited for the
    transfers in flight while nobody polled them: it sat out its whole timeout, then failed
    stores that had landed long before with "closed" (and ended their sessions unclean)."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        transport.hold = True
        first, second = tier.store(["a"], [0]), tier.store(["b"], [1])
        first_tid, second_tid = transport.in_flight()
        first.add_done_callback(lambda _: tier.close(timeout=60.0))
        transport.land(first_tid)  # the poller resolves it: its callback closes the tier
        wait_until(lambda: tier.closed, "the callback closed the tier")
        transport.land(second_tid)
        assert second.result(timeout=10).ok  # not "closed" once close's 60 s ran out
        assert first.result(timeout=0).ok


def test_a_store_does_not_raise_when_a_peer_joins_while_it_looks_at_the_peers() -> None:
    """Whether a store computes digests was read from the peer table without the lock (a
    tier with ``verify=False`` walks it); a peer added or dropped by another thread meanwhile
    (a redial, a lost session) made the store raise "dictionary changed size during
    iteration" (7 of 8,000 stores beside a thread adding and removing peers)."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}, verify=False) as (tier, _):

        class JoinsMeanwhile:
            """A peer whose ``verifies`` is read as another thread adds a peer."""

            @property
            def verifies(self) -> bool:
                tier._peers["joined"] = tier._peers["p"]
                return False

            def report_usage(self) -> None: ...

        tier._peers["looked at"] = JoinsMeanwhile()  # type: ignore[assignment]
        try:
            stored = tier.store(["a"], [0])
        finally:
            del tier._peers["looked at"], tier._peers["joined"]
        assert stored.result(timeout=5).ok


@pytest.mark.parametrize("interval", [-1.0, float("nan")])
def test_a_bad_poll_interval_is_refused_before_the_poller_starts(interval: float) -> None:
    """A negative ``max_poll_interval_s`` was taken: once idle, the poller's back-off slept a
    negative time, ``time.sleep`` raised and the thread died, so no transfer completed on it
    any more and every future that waited for one hung."""
    arena = BlockArena(4, BLOCK)
    threads = threading.active_count()
    with pytest.raises(ValueError, match="max_poll_interval_s"):
        TierManager(arena, LateWriteTransport(arena.tensor), max_poll_interval_s=interval)
    assert threading.active_count() == threads


def test_a_future_cannot_be_cancelled_while_its_transfer_is_in_flight() -> None:
    """A store's or load's future could be cancelled (``asyncio.wait_for`` over
    ``asyncio.wrap_future`` does so on its timeout): a load's then reported done while its read
    could still land in its blocks, and resolving it raised ``InvalidStateError``, on the
    poller (which then stopped resolving futures) or in an unrelated caller's call."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        transport.hold = True
        first = tier.store(["a"], [0])
        assert not first.cancel() and not first.done()
        (tid,) = transport.in_flight()
        transport.land(tid)
        assert first.result(timeout=5).ok
        second = tier.store(["b"], [1])
        (tid,) = transport.in_flight()
        transport.land(tid)
        assert second.result(timeout=5).ok
