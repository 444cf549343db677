"""Races and stalls in a tier's own bookkeeping, found by review, each on a tier whose transport
and host sessions are in this process (``LateWriteTransport``; ``_SharedSession``): futures that
must resolve whatever else is in flight, slots that must go out to the stores waiting for them,
and hosts that must be dialled again whenever their session is lost."""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zmq
from remote_support import BLOCK_LEN, free_port, wait_for
from test_index import LateWriteTransport, late_write_tier

from torch_kv_tier import connections, session_releases
from torch_kv_tier.arena import BlockArena
from torch_kv_tier.connections import Dial, Redialer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.promotions import Parked, Promotions
from torch_kv_tier.records import Request, resolve
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.greeting import Greeting
from torch_kv_tier.remote.protocol import ON_DISK
from torch_kv_tier.shared_host import MAX_PROMOTING, SharedHost

RESULT_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


class _SharedSession:
    """What a tier uses of a shared ``RemoteSession``; grant requests wait in ``grants`` until
    the test answers them."""

    def __init__(self, peer_id: str, max_granted: int) -> None:
        self.peer_id, self.address, self.session_id = peer_id, f"{peer_id}:1", f"sid-{peer_id}"
        self.shared, self.max_granted, self.lost = True, max_granted, None
        self.agent_metadata, self.base_addr, self.num_blocks, self.block_len = b"", 0, 8, BLOCK_LEN
        self.grants: list[Any] = []
        self.promoted: list[Any] = []
        self.closed: list[bool] = []
        self.ended_clean = False

    def grant(self, want: int, on_answer: Any, *, with_commits: bool = False) -> None:
        self.grants.append(on_answer)

    def answer(self, slots: list[int]) -> None:
        future: Future[p.ServerMessage] = Future()
        future.set_result(p.Granted(1, slots))
        self.grants.pop(0)(future)

    def promote(self, keys: list[Any]) -> None:
        self.promoted += keys

    def close(self, *, clean: bool = True) -> None:
        self.closed.append(clean)

    def commit(self, *args: Any) -> None: ...
    def touch(self, *args: Any) -> None: ...
    def follow(self, *args: Any) -> None: ...
    def send_batched(self) -> None: ...
    def report_usage(self, **kwargs: Any) -> None: ...
    def release(self, *args: Any) -> None: ...
    def unsent_commits(self) -> list[Any]:
        return []

    def unreleased(self) -> list[str]:
        return []


@contextmanager
def _tier(max_inflight: int = 64) -> Iterator[tuple[TierManager, LateWriteTransport]]:
    """A tier whose writes stay in flight until landed, and a private peer ``r0``'s memory
    (8 slots; not added), closed on exit, a failing test's too."""
    arena = BlockArena(16, BLOCK_LEN)
    with late_write_tier(arena, {}, max_inflight=max_inflight) as (tier, transport):
        transport.remotes[b"r0"] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        transport.hold = True
        yield tier, transport


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


def _add_shared_host(tier: TierManager, max_granted: int) -> tuple[SharedHost, _SharedSession]:
    """A shared host ``h`` (8 slots) published as ``_join_shared`` does, without a network."""
    assert isinstance(tier.transport, LateWriteTransport)
    tier.transport.remotes[b"h"] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
    tier.transport.add_remote_peer("h", b"h", 0, 8, BLOCK_LEN)
    session = _SharedSession("h", max_granted)
    with tier._lock:
        slots = tier._index.add_shared_peer("h", 8)
        host = tier._peers["h"] = SharedHost(slots, session, max_granted)
    return host, session


def _granted_host(tier: TierManager, slots: list[int]) -> _SharedSession:
    """A shared host ``h`` that granted ``slots`` (and no more) to ``tier``."""
    host, session = _add_shared_host(tier, max_granted=len(slots))
    with tier._lock:
        tier._refill(host)
    session.answer(slots)
    return session


@pytest.mark.parametrize("settled_by", ["its timeout", "the host's announcement"])
def test_a_parked_load_resolves_while_another_transfer_stays_in_flight(settled_by: str) -> None:
    """A load parked until a host promotes its key from disk settles "missing" (its timeout
    passed, or the host announced the key gone); the poller resolved such a request only when
    nothing else was in flight, so a write held in flight (a frozen host) kept it pending."""
    with _tier() as (tier, transport):
        tier.add_peer("r0", b"r0", 0, 8, BLOCK_LEN)
        tier.store([b"held"], [0])  # stays in flight
        host, session = _add_shared_host(tier, 8)
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
    with _tier() as (tier, _):
        host, _ = _add_shared_host(tier, 8)
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
    with _tier(max_inflight=1) as (tier, transport):
        host, _ = _add_shared_host(tier, 8)
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

    with _tier() as (tier, _):
        host, session = _add_shared_host(tier, 8)
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
    with _tier() as (tier, transport):
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
    with _tier() as (tier, transport):
        host, session = _add_shared_host(tier, 8)
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
    with _tier() as (tier, transport):
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


def test_a_join_whose_session_is_lost_before_the_index_came_fails_at_once() -> None:
    """A shared host lost while the tier waits for its index: the join fails with
    ``ConnectionError`` at once (it waited out its whole timeout, then raised ``KeyError``),
    the host is dropped and its session ended clean (no store of it in flight)."""
    with _tier() as (tier, transport):
        transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        session = _SharedSession("h", 8)
        threading.Timer(0.2, lambda: setattr(session, "lost", "reset")).start()
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="lost before it sent its index"):
            tier._join_shared(session, timeout_s=30.0)
        assert time.monotonic() - start < 5.0
        assert tier.peers() == [] and session.closed == [True]


def test_a_redial_whose_join_fails_keeps_the_host_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """A redial whose new session was lost before the host's index came fails, and the host is
    still to be dialled: the failed join used to remove the host as a user's ``remove_peer``
    does, which ended the redialling for good."""
    with _tier() as (tier, transport):
        session = _SharedSession("h", 8)
        session.lost = "reset"  # lost as soon as it joined
        transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        monkeypatch.setattr(TierManager, "_open", lambda self, dial, release, private: session)
        dial = Dial("h:1", None, False, None, 1.0, 1.0)
        tier._dials["h"] = dial  # the host was connected before, then lost
        with pytest.raises(ConnectionError):
            tier._redial(dial)
        assert tier._wants_dial(dial) and tier.peers() == []


class _PrivateSession(_SharedSession):
    """A private lease's session as ``_connect`` uses it."""

    def __init__(self) -> None:
        super().__init__("host-1", 0)
        self.shared, self.lease = False, range(8)


def test_a_host_removed_while_it_is_redialled_stays_removed_and_is_then_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The user removes a lost host while the redialer's handshake with it runs: the session
    that handshake opens ends at once, and then the tier forgets the host (how it was dialled
    stayed in ``_removed`` for good; forgetting it while the redial ran let the host back)."""
    with _tier() as (tier, transport):
        session = _PrivateSession()
        session.address = "host:1"
        transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        entered, go = threading.Event(), threading.Event()

        def slow_open(self: TierManager, dial: Dial, release: list[str], private: bool) -> Any:
            entered.set()
            go.wait(timeout=RESULT_TIMEOUT_S)
            return session

        monkeypatch.setattr(TierManager, "_open", slow_open)
        dial = Dial("host:1", None, True, None, 1.0, 1.0)
        tier._dials["host-1"] = dial  # the host was connected before, then lost
        redial = threading.Thread(target=tier._redial, args=(dial,), daemon=True)
        redial.start()
        assert entered.wait(timeout=RESULT_TIMEOUT_S)
        tier.remove_peer("host-1")
        assert tier._removed == {"host:1": dial}  # the redial in progress still needs it
        go.set()
        redial.join(timeout=RESULT_TIMEOUT_S)
        assert not redial.is_alive() and tier.peers() == [] and session.closed
        assert wait_for(lambda: not tier._removed, 5.0), tier._removed
        assert not tier._wants_dial(dial)


def test_a_session_lost_right_after_connect_published_it_is_dialled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session's I/O thread reported it lost after its peer was published but before
    ``connect`` had recorded how to dial it: the drop found no dial, and the host was never
    dialled again."""
    with _tier() as (tier, transport):
        session = _PrivateSession()
        transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        monkeypatch.setattr(TierManager, "_open", lambda self, dial, release, private: session)
        add_private = TierManager._add_private

        def add_then_lose(self: TierManager, *args: Any) -> None:
            add_private(self, *args)
            session.lost = "the control connection was reset"  # as the session's I/O thread does
            self._on_session_lost(session.peer_id)

        monkeypatch.setattr(TierManager, "_add_private", add_then_lose)
        dialled: list[Dial] = []
        monkeypatch.setattr(tier._redialer, "start", dialled.append)
        assert tier.connect("host:1", private=True) == "host-1"
        assert wait_for(lambda: bool(dialled), 5.0), "the lost host is never dialled again"
        assert dialled[0].address == "host:1" and tier.peers() == []


def test_a_redial_whose_new_session_is_lost_at_once_dials_again() -> None:
    """The redialer forgot a host whose dial succeeded, even when the new session was lost
    before the dial returned (the drop then found the host still due, and added nothing)."""
    spec = Dial("host:1", None, False, None, 1.0, 1.0)
    dials: list[Dial] = []

    class _Tier:  # the redialer holds its tier's methods weakly
        def dial(self, dial: Dial) -> None:
            dials.append(dial)

        def wanted(self, dial: Dial) -> bool:
            return len(dials) < 2  # the first session is lost at once, the second stays

    owner = _Tier()
    redialer = Redialer(owner.dial, owner.wanted)
    redialer.start(spec)
    try:
        assert wait_for(lambda: len(dials) == 2, 10.0), dials
    finally:
        redialer.stop(timeout=5.0)


def test_a_host_lost_again_as_its_redial_ends_is_dialled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a redial joined its host, the redialer saw it joined (not wanted any
    more), and the new session was lost before the redialer forgot the host. The drop found
    the host still due and added nothing, then the redialer forgot it: the host was never
    dialled again. A host lost as its redial ends is dialled again."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.05)
    spec = Dial("host:1", None, False, None, 1.0, 1.0)
    dials: list[Dial] = []

    class _Tier:  # the redialer holds its tier's methods weakly
        joined = False

        def dial(self, dial: Dial) -> None:
            dials.append(dial)
            self.joined = True

        def wanted(self, dial: Dial) -> bool:
            wanted = not self.joined
            if len(dials) == 1 and self.joined:  # the first new session is lost right after
                self.joined = False
                redialer.start(spec)  # what the drop does (``_end_dropped``)
            return wanted

    owner = _Tier()
    redialer = Redialer(owner.dial, owner.wanted)
    redialer.start(spec)
    try:
        assert wait_for(lambda: len(dials) == 2, 10.0), "the host lost again is never dialled"
    finally:
        redialer.stop(timeout=5.0)


def test_a_redial_thread_that_cannot_start_is_tried_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a process at its thread limit (``RuntimeError: can't start new
    thread``) killed the redialer's thread, so no lost host was ever dialled again, and left a
    thread that never started among the tries, so ``close`` raised joining it (so did one of
    the redialer's own thread, which ``start`` then raised to the drop of a lost host). The
    try (or the greeting) is put off to its next round, the redialer's thread started by the
    next ``start``, and ``stop`` ends as it does."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.0)  # every host due at once
    monkeypatch.setattr(connections, "MAX_CONNECTS", 1)
    monkeypatch.setattr(Greeting, "add", lambda *_: False)  # each host then tried, as answering
    start = threading.Thread.start
    refused: list[str] = []

    def start_unless_refused(thread: threading.Thread) -> None:
        kind = getattr(getattr(thread, "_target", None), "__name__", "")
        if kind in ("_run", "_try_once", "_greet") and kind not in refused:
            refused.append(kind)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_unless_refused)
    specs = [Dial(f"host:{i}", None, False, None, 1.0, 1.0) for i in (1, 2, 3)]
    dials: list[Dial] = []

    class _Tier:  # the redialer holds its tier's methods weakly
        def dial(self, dial: Dial) -> None:
            dials.append(dial)

        def wanted(self, dial: Dial) -> bool:
            return dial not in dials

    owner = _Tier()
    redialer = Redialer(owner.dial, owner.wanted)
    try:
        with redialer._lock:  # 3 hosts due, 1 try: a greeting, then the tries of those answering
            for spec in specs:
                redialer.start(spec)
        assert wait_for(lambda: len(dials) == 3, 10.0), f"hosts never dialled: {dials}"
        assert refused == ["_run", "_greet", "_try_once"]
    finally:
        redialer.stop(timeout=5.0)


def test_a_redialer_whose_thread_could_not_start_is_started_by_the_poller(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: a redialer whose thread could not start (the process at its thread
    limit) at the tier's first connect, nor at the loss of a host, was started only by the next
    connect or loss: the lost host was not dialled again until then, however long that took.
    The tier's poller starts it (it looks about once a second), warning once, not at each
    look."""
    caplog.set_level(logging.DEBUG, logger=connections.__name__)
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.0)
    with _tier() as (tier, _):
        dialled = threading.Event()

        def down(self: TierManager, dial: Dial, release: list[str], private: bool) -> Any:
            dialled.set()
            raise TimeoutError("down (a test)")

        monkeypatch.setattr(TierManager, "_open", down)
        start, refused = threading.Thread.start, []

        def refuse_twice(thread: threading.Thread) -> None:
            if getattr(thread, "_target", None) == tier._redialer._run and len(refused) < 2:
                refused.append(thread)
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", refuse_twice)
        tier._redialer.arm()  # as the host's connect does: refused
        dial = Dial("h:1", None, False, None, 1.0, 1.0)
        with tier._lock:
            tier._dials["h"] = dial  # the host was connected, then lost
            tier._redialer.start(dial)  # as its loss does: refused again
        assert len(refused) == 2
        assert dialled.wait(RESULT_TIMEOUT_S), "the lost host is not dialled again"
    warned = [r for r in caplog.records if "could not start the thread re-dial" in r.message]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.DEBUG]


def test_close_ends_the_sessions_of_frozen_hosts_within_one_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close`` ends every host's session side by side within its timeout (found by review:
    it waited for each in turn with the whole timeout, so N frozen hosts took N times it).
    The wait is counted on a clock that each join moves on by the timeout it was given (a
    host that does not answer holds its thread past any), not on the wall clock a loaded
    machine stretches."""
    release = threading.Event()
    monkeypatch.setattr(
        session_releases, "end_session", lambda *_args: release.wait(30) and []
    )  # a host that does not answer
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(
        session_releases, "time", types.SimpleNamespace(monotonic=lambda: clock.now)
    )
    sessions = [
        type("S", (), {"address": f"h{i}:1", "session_id": f"s{i}", "ended_clean": False})()
        for i in range(4)
    ]
    arena = BlockArena(4, BLOCK_LEN)
    tier = TierManager(arena, LateWriteTransport(arena.tensor))
    joined: list[threading.Thread] = []

    def unanswered(thread: threading.Thread, timeout: float | None = None) -> None:
        assert timeout is not None, "a last word awaited without a timeout"
        joined.append(thread)
        clock.now += timeout

    try:
        with monkeypatch.context() as waits:
            waits.setattr(threading.Thread, "join", unanswered)
            tier._end_sessions([(s, True) for s in sessions], 0.5)
        assert len(joined) == 4 and all(t.is_alive() for t in joined)  # each awaited, unanswered
        assert clock.now == 1000.5  # 1002.0 when each waited 0.5 s in turn
    finally:
        release.set()
        tier.close()


class _UnansweredSession(_PrivateSession):
    """A private session that carried releases (past the handshake's first ``MAX_RELEASE``:
    ``Release`` messages) and whose disconnect went unanswered: its host may not have read
    them (``RemoteSession.unreleased``)."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[list[str]] = []

    def release(self, held: list[str]) -> None:
        self.told.append(held)

    def unreleased(self) -> list[str]:
        return ["sid-a", "sid-b"]


@pytest.mark.parametrize(
    "ended_by", ["a release of its own", "a second connect", "a failed add", "a failed join"]
)
def test_a_session_the_tier_ends_unused_keeps_the_releases_it_carried(
    ended_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session the tier opened and ended at once (only to carry releases to a host it has no
    session with, a connect of a host connected already, a host it could not register) ended
    with a bare ``close``: the ended sessions it released that its host never read were
    forgotten, and the host held their slots for good. They are kept to be named again."""
    with _tier() as (tier, transport):
        transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        sessions = [_UnansweredSession(), _UnansweredSession()]
        monkeypatch.setattr(TierManager, "_open", lambda *_a, **_k: sessions.pop(0))
        dial = Dial("host-1:1", None, True, None, 1.0, 1.0)
        if ended_by == "a release of its own":
            tier._release_over_own_session(dial, ["sid-a", "sid-b"])
        elif ended_by == "a second connect":
            assert tier._connect(dial) == tier._connect(dial) == "host-1"
        else:
            sessions[0].shared = ended_by == "a failed join"
            sessions[0].agent_metadata = b"unregistered"  # the transport refuses it
            with pytest.raises(KeyError):
                tier._connect(dial)
        if ended_by == "a second connect":  # told at once, over the host's live session
            assert sessions == [] and not tier._ended.resolved, tier._ended.resolved
            assert tier._peers["host-1"].session.told == [["sid-a", "sid-b"]]  # type: ignore[union-attr]
        else:
            assert tier._ended.resolved == {"host-1:1": ["sid-a", "sid-b"]}, tier._ended.resolved


class _AnsweringHost:
    """A ZeroMQ ROUTER on 127.0.0.1 that answers every frame it gets (any answer is one, for a
    greeting): a host that is back. Close with ``close``."""

    def __init__(self) -> None:
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(10, zmq.POLLIN):
                self._sock.send_multipart(self._sock.recv_multipart())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=RESULT_TIMEOUT_S)
        self._sock.close()


def test_a_host_due_while_silent_hosts_are_greeted_is_greeted_and_tried_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: more hosts falling due than tries may start while a greeting ran (a
    second rack lost, say) waited for that whole greeting to end, up to its longest timeout, a
    host among them that is back too: they were greeted only in the next round. They join the
    greeting under way now, each answer tried at once, while the silent hosts greeted before
    them still await their own timeout."""
    monkeypatch.setattr(connections, "MAX_CONNECTS", 4)
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.0)  # each host due once lost
    timeout_s = 30.0  # (the greeting's: each silent host's wait, unless stopped)
    silent = [
        Dial(f"127.0.0.1:{free_port()}", None, False, None, timeout_s, 1.0) for _ in range(48)
    ]
    back = _AnsweringHost()
    spec = Dial(back.address, None, False, None, timeout_s, 1.0)
    greeted_at_dial: list[bool] = []

    class _Tier:  # the redialer holds its tier's methods weakly
        def dial(self, dial: Dial) -> None:
            if dial is spec:
                with redialer._lock:
                    greeted_at_dial.append(set(silent[:40]) <= redialer._greeting)
            raise ConnectionError("not a host (a test)")

        def wanted(self, dial: Dial) -> bool:
            return dial is not spec or not greeted_at_dial

    owner = _Tier()
    redialer = Redialer(owner.dial, owner.wanted)
    try:
        with redialer._lock:  # 40 silent hosts lost at once: greeted
            for lost in silent[:40]:
                redialer.start(lost)
        assert wait_for(lambda: set(silent[:40]) <= redialer._greeting, RESULT_TIMEOUT_S)
        began = time.monotonic()
        with redialer._lock:  # 9 more lost, more than tries may start: one of them is back
            for lost in [*silent[40:], spec]:
                redialer.start(lost)
        assert wait_for(lambda: bool(greeted_at_dial), RESULT_TIMEOUT_S), "never tried"
        logger.info("the host back was tried %.3f s after it fell due", time.monotonic() - began)
        assert greeted_at_dial == [True], "tried only once the silent hosts' greeting ended"
    finally:
        redialer.stop(timeout=5.0)
        back.close()


def test_a_host_silent_at_its_greeting_is_tried_after_its_backoff_while_others_are_greeted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a host that did not answer its greeting, while the greeter went on
    awaiting others, had its next try set after its backoff, but the redialer's thread was not
    woken and slept until the next try it knew of (another lost host's, up to
    ``REDIAL_MAX_S`` away): the host waited for that. The greeter wakes it."""
    monkeypatch.setattr(connections, "MAX_CONNECTS", 1)  # 2 hosts due at once: greeted
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.05)
    quick = Dial(f"127.0.0.1:{free_port()}", None, False, None, 0.3, 1.0)  # silent, 0.3 s
    slow = Dial(f"127.0.0.1:{free_port()}", None, False, None, 30.0, 1.0)  # silent, 30 s
    tried = threading.Event()

    class _Tier:  # the redialer holds its tier's methods weakly
        def dial(self, dial: Dial) -> None:
            if dial is quick:
                tried.set()
            raise ConnectionError("not a host (a test)")

        def wanted(self, dial: Dial) -> bool:
            return True

    owner = _Tier()
    redialer = Redialer(owner.dial, owner.wanted)
    try:
        with redialer._lock:
            redialer.start(quick)
            redialer.start(slow)
        assert wait_for(lambda: {quick, slow} <= redialer._greeting, RESULT_TIMEOUT_S)
        monkeypatch.setattr(connections, "REDIAL_FIRST_S", 60.0)
        redialer.start(Dial(f"127.0.0.1:{free_port()}", None, False, None, 1.0, 1.0))  # in 60 s
        assert tried.wait(RESULT_TIMEOUT_S), "the silent host waited for another host's try"
    finally:
        redialer.stop(timeout=5.0)


def test_stop_waits_for_a_greeter_that_saw_it_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a greeter that saw ``stop`` before ``stop`` looked for the threads to
    join had let go of itself already: it was still closing its sockets (one for each host it
    awaited) after ``stop`` (and the tier's ``close``) returned. ``stop`` joins it."""
    monkeypatch.setattr(connections, "MAX_CONNECTS", 1)  # 2 hosts due at once: greeted
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.0)
    close, take = Greeting.close, Redialer._take_greetings
    saw_stop = threading.Event()

    def slow_close(greeting: Greeting[Dial]) -> None:  # (as one of many sockets)
        time.sleep(0.5)
        close(greeting)

    def take_greetings(redialer: Redialer, greeting: Greeting[Dial]) -> bool:
        more = take(redialer, greeting)
        if not more:
            saw_stop.set()
        return more

    class _Stop(threading.Event):
        def set(self) -> None:  # ``stop``'s thread is paused while the greeter sees it
            super().set()
            saw_stop.wait(RESULT_TIMEOUT_S)

    monkeypatch.setattr(Greeting, "close", slow_close)
    monkeypatch.setattr(Redialer, "_take_greetings", take_greetings)
    silent = [Dial(f"127.0.0.1:{free_port()}", None, False, None, 30.0, 1.0) for _ in range(2)]

    class _Tier:  # the redialer holds its tier's methods weakly
        def dial(self, dial: Dial) -> None:
            raise ConnectionError("not a host (a test)")

        def wanted(self, dial: Dial) -> bool:
            return True

    owner = _Tier()
    redialer = Redialer(owner.dial, owner.wanted)
    redialer._stop = _Stop()
    with redialer._lock:
        for spec in silent:
            redialer.start(spec)
    assert wait_for(lambda: set(silent) <= redialer._greeting, RESULT_TIMEOUT_S)
    greeter = redialer._greeter
    assert greeter is not None
    redialer.stop(timeout=RESULT_TIMEOUT_S)
    assert saw_stop.is_set()
    assert not greeter.is_alive(), "the greeter outlived stop"


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
