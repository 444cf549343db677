"""Races and stalls in a tier's own bookkeeping, found by review, each on a tier whose transport
and host sessions are in this process (``tier_races_support``): futures that must resolve
whatever else is in flight (parked loads, promotions, a Ctrl-C as a future resolves), and slots
that must go out to the stores waiting for them or serve another key once a write failed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from late_write_support import LateWriteTransport, late_write_tier
from remote_support import BLOCK_LEN, wait_for
from tier_races_support import RESULT_TIMEOUT_S, SharedSession, add_shared_host, in_process_tier

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.promotions import Parked, Promotions
from torch_kv_tier.records import Request, resolve
from torch_kv_tier.remote.protocol import ON_DISK
from torch_kv_tier.shared_host import MAX_PROMOTING


def _hold_reads(transport: LateWriteTransport) -> list[tuple[int, str]]:
    """Keep ``transport``'s reads in flight (their bytes arrive at once) until ``_report``;
    returns the reads held, as (transfer id, peer id)."""
    read, held = transport.read_blocks, []

    def read_blocks(peer_id: str, local: Any, remote: Any) -> int | None:
        tid = read(peer_id, local, remote)
        with transport._lock:
            del transport._done[tid]
        held.append((tid, peer_id))
        return tid

    transport.read_blocks = read_blocks  # type: ignore[method-assign]
    return held


def _report(transport: LateWriteTransport, read: tuple[int, str]) -> None:
    """The transport reports a read ``_hold_reads`` held."""
    with transport._lock:
        transport._done[read[0]] = read[1]


def _granted_host(tier: TierManager, slots: list[int]) -> SharedSession:
    """A shared host ``h`` that granted ``slots`` (and no more) to ``tier``."""
    host, session = add_shared_host(tier, max_granted=len(slots))
    with tier._lock:
        tier._refill(host)
    session.answer(slots)
    return session


@pytest.mark.parametrize("settled_by", ["its timeout", "the host's announcement"])
def test_a_parked_load_resolves_while_another_transfer_stays_in_flight(settled_by: str) -> None:
    """A load parked until a host promotes its key from disk settles "missing" (its timeout
    passed, or the host announced the key gone); the poller resolved such a request only when
    nothing else was in flight, so a write held in flight (a frozen host) kept it pending."""
    with in_process_tier() as (tier, transport):
        tier.add_peer("r0", b"r0", 0, 8, BLOCK_LEN)
        tier.store([b"held"], [0])  # stays in flight
        host, session = add_shared_host(tier, 8)
        with tier._lock:
            tier._apply_host_changes(host, ([b"cold"], [ON_DISK], [0], [], False, ()))
        tier.promotion_timeout_s = 0.3 if settled_by == "its timeout" else 60.0
        load = tier.load([b"cold"], [3])
        assert session.promoted == [b"cold"]
        if settled_by == "the host's announcement":
            with tier._lock:  # its disk dropped the key
                tier._apply_host_changes(host, ([], [], [], [b"cold"], False, ()))
        result = load.result(timeout=RESULT_TIMEOUT_S)
        assert result.failed == {b"cold": "missing"}
        assert transport.in_flight()  # still: the load did not wait for it
        for tid in transport.in_flight():
            transport.land(tid)


def test_a_parked_load_times_out_while_other_loads_keep_parking() -> None:
    """An idle poller looked at the parked loads' deadlines only when its 0.1 s wait ran out,
    and each load that parks wakes it: while loads kept parking more often than that (a host
    that promotes nothing, asked by a busy scheduler), no parked load ever timed out."""
    with in_process_tier() as (tier, _):
        host, _ = add_shared_host(tier, 8)
        cold = [b"cold%d" % i for i in range(400)]
        with tier._lock:
            tier._apply_host_changes(host, (cold, [ON_DISK] * 400, [0] * 400, [], False, ()))
        tier.promotion_timeout_s = 0.2
        first = tier.load([cold[0]], [0])
        for key in cold[1:]:  # one more parks every 10 ms, for 4 s at most
            if first.done():
                break
            tier.load([key], [1])
            time.sleep(0.01)
        assert first.done(), "the first parked load outlived its timeout by seconds"
        assert first.result().failed == {cold[0]: "missing"}


def test_parked_loads_are_not_walked_while_none_can_have_expired() -> None:
    """The poller asks for expired promotions on every turn while transfers are in flight (it
    spins then); the answer walked every parked load under the tier's lock each time (~0.4 ms
    for 1,000 of them). It now keeps the earliest deadline and walks them only once that
    passed."""
    reads = 0

    class Counted(Parked):
        def __getattribute__(self, name: str) -> Any:
            nonlocal reads
            reads += name == "deadline"
            return super().__getattribute__(name)

    promotions = Promotions()
    for i in range(100):
        promotions.park(f"h{i % 2}", Counted(Request([i]), [i], [i], 100.0 + i))
    reads = 0
    assert promotions.take_expired(50.0) == [] and reads == 0
    (first,) = promotions.take_expired(100.5)
    assert first.keys == [0]
    reads = 0
    assert promotions.take_expired(100.9) == [] and reads == 0
    assert [w.keys for w in promotions.take_expired(101.0)] == [[1]]
    assert len(promotions.take_all()) == 98


def test_a_parked_load_its_host_promotes_while_the_tier_closes_still_resolves() -> None:
    """``close`` failed the loads parked for a promotion only after its wait for the transfers
    in flight; a host announcing their keys meanwhile launched them, behind ``max_inflight``
    into the peer's queue, which ``close`` had already emptied: that load never resolved."""
    with in_process_tier(max_inflight=1) as (tier, transport):
        host, _ = add_shared_host(tier, 8)
        with tier._lock:
            tier._apply_host_changes(host, ([b"hot", b"cold"], [5, ON_DISK], [0, 0], [], False, ()))
        reads = _hold_reads(transport)
        busy = tier.load([b"hot"], [2])  # the host's one in-flight transfer
        parked = tier.load([b"cold"], [3])
        closer = threading.Thread(target=tier.close, kwargs={"timeout": 1.0})
        closer.start()
        assert wait_for(lambda: tier.closed, 5.0)
        tier._on_host_changes(host, ([b"cold"], [6], [0], [], False, ()))  # promoted
        closer.join(timeout=RESULT_TIMEOUT_S)
        assert not closer.is_alive()
        assert busy.result(timeout=RESULT_TIMEOUT_S).failed == {b"hot": "closed"}
        assert parked.result(timeout=RESULT_TIMEOUT_S).failed == {b"cold": "closed"}
        assert len(reads) == 1


def test_promotions_asked_are_forgotten_without_walking_the_recent_ones() -> None:
    """Past ``MAX_PROMOTING`` remembered promotions, every load of a key on disk walked all of
    them (under the tier's lock) to forget those asked long ago, even when none was: after a
    burst of more than 4,096 promotions, each such load paid for the whole burst."""
    unpacked = 0

    class Asked(tuple):  # (first asked, last asked), counting the walks that look into it
        def __iter__(self) -> Any:
            nonlocal unpacked
            unpacked += 1
            return super().__iter__()

    with in_process_tier() as (tier, _):
        host, session = add_shared_host(tier, 8)
        now = 1000.0
        host.promoting.update((b"old%d" % i, Asked((now - 60.0, now - 60.0))) for i in range(10))
        host.promoting.update((b"new%d" % i, Asked((now, now))) for i in range(MAX_PROMOTING))
        unpacked = 0
        assert host.promote([b"k"], now, 5.0) == [b"k"] and session.promoted == [b"k"]
        assert unpacked <= 11  # the old ones, and the first recent one
        assert not any(key.startswith(b"old") for key in host.promoting)
        assert len(host.promoting) == MAX_PROMOTING + 1


def test_slots_a_discarded_store_returns_go_to_the_stores_waiting_for_slots() -> None:
    """A store waited for slots while an earlier store held the tier's whole grant and the host
    granted no more (its cap); every key of the earlier store was discarded, so it committed
    nothing and asked for nothing, and its slots went back unused while the store waited."""
    with in_process_tier() as (tier, transport):
        session = _granted_host(tier, [0, 1, 2, 3])
        first = tier.store([b"a0", b"a1", b"a2", b"a3"], range(4))
        waiting = tier.store([b"b0", b"b1"], [4, 5])
        session.answer([])  # the host's cap: nothing more until a commit
        tier.discard([b"a0", b"a1", b"a2", b"a3"])
        (tid,) = transport.in_flight()
        transport.land(tid)
        assert first.result(timeout=RESULT_TIMEOUT_S).ok
        assert wait_for(lambda: bool(transport.in_flight()), 5.0), "the waiting store never went"
        for tid in transport.in_flight():
            transport.land(tid)
        assert waiting.result(timeout=RESULT_TIMEOUT_S).ok


def test_a_store_the_host_has_no_slots_for_fails_once_only_loads_were_in_flight() -> None:
    """A grant answered with no slots fails the stores waiting for it with "capacity" unless
    a write of this tier to the host is in flight (its commit makes room). A load in flight
    counted as such a write: the tier asked for nothing more (its grant came short), the load
    freed nothing, and the store waited until the session ended."""
    with in_process_tier() as (tier, transport):
        host, session = add_shared_host(tier, 8)
        with tier._lock:
            tier._apply_host_changes(host, ([b"k"], [5], [0], [], False, ()))
        reads = _hold_reads(transport)
        load = tier.load([b"k"], [3])
        assert reads and not load.done()
        store = tier.store([b"s"], [0])  # no granted slot: waits, and asks the host
        session.answer([])  # none: nothing this tier does could free its share
        _report(transport, reads[0])
        assert load.result(timeout=RESULT_TIMEOUT_S).failed == {b"k": "missing"}  # its digest
        assert store.result(timeout=RESULT_TIMEOUT_S).failed == {b"s": "capacity"}


@pytest.mark.parametrize("final", [False, True], ids=["may-still-land", "final"])
def test_a_failed_write_holds_its_session_unless_failures_are_final(final: bool) -> None:
    """A write that failed may still land part-way, so its session must not end clean: it did,
    and the host handed the slots on while the stray write could still reach them. The NIXL
    transport reports a failure only once nothing more of it lands (``failures_are_final``):
    then the session ends clean, and the host frees its slots at once instead of holding them
    until ``--hold-timeout``."""
    with in_process_tier() as (tier, transport):
        transport.failures_are_final = final
        session = _granted_host(tier, [0, 1, 2, 3])
        store = tier.store([b"a0", b"a1"], [0, 1])
        (tid,) = transport.in_flight()
        transport.fail(tid)
        assert store.result(timeout=RESULT_TIMEOUT_S).failed == {
            b"a0": "transfer failed",
            b"a1": "transfer failed",
        }
        assert wait_for(lambda: session.closed == [final], 5.0), session.closed
        if not final:
            transport.land(tid)
        # never told to the host unless final: its hold ends it
        assert tier.stats().unreleased_sessions == (0 if final else 1)


@pytest.mark.parametrize("dropped_first", [False, True])
def test_a_slot_whose_write_failed_finally_serves_another_key(dropped_first: bool) -> None:
    """With final failures, a failed write's slot comes back (it stayed fenced for good, which
    a transport whose failed writes may still land needs: ``test_index``), whether the write
    failed in its peer's hands or after the peer was dropped."""
    arena = BlockArena(4, BLOCK_LEN)
    arena.tensor[1].fill_(0xBB)
    with late_write_tier(arena, {"p": 1}) as (tier, transport):
        transport.failures_are_final = True
        transport.hold = True
        first = tier.store(["a"], [0])
        (tid,) = transport.in_flight()
        if dropped_first:
            transport.fault("p", "state check raised")
            wait_for(lambda: tier.peers() == [], 5.0)
        transport.fail(tid)
        assert first.result(timeout=RESULT_TIMEOUT_S).failed
        assert wait_for(lambda: tier.stats().inflight == 0, 5.0)
        if not dropped_first:
            assert wait_for(lambda: tier.peers() == [], 5.0)
        tier.add_peer("p", b"p", 0, 1, BLOCK_LEN)  # the same memory under the same peer id
        transport.hold = False
        assert tier.store(["b"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
        assert tier.load(["b"], [2]).result(timeout=RESULT_TIMEOUT_S).ok
        assert torch.equal(arena.tensor[2], arena.tensor[1])


@pytest.mark.parametrize("where", ["a callback", "building a result"])
def test_a_ctrl_c_as_a_future_resolves_leaves_no_other_future_of_its_batch_unresolved(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Found by review: the tier resolves the futures it settled together in one pass (on the
    caller's thread too, in ``store``/``load``); a ``KeyboardInterrupt`` there (a done-callback
    of one, or Ctrl-C as its result was built) skipped the rest of the batch for good: their
    waiters hung until their timeouts, an offload's slots were never handed back. Now each is
    resolved, and the interrupt still reaches the caller."""
    ready = [Request([key]) for key in (b"a", b"b", b"c")]
    for request in ready:
        request.settle(request.keys, None)

    def interrupt(_: object) -> None:
        raise KeyboardInterrupt

    if where == "a callback":
        ready[0].future.add_done_callback(interrupt)
    else:
        result = Request.result
        interrupts = iter([True])

        def interrupted(request: Request) -> Any:
            if next(interrupts, False):
                raise KeyboardInterrupt
            return result(request)

        monkeypatch.setattr(Request, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve(ready)
    assert [r.future.result(timeout=0).keys for r in ready] == [[b"a"], [b"b"], [b"c"]]
