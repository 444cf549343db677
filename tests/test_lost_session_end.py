"""A store or load whose transfer the transport refuses drops its host, and that host's session
must end (then the host is dialled again): the thread that ends it is started by the tier's
``session_ends`` thread, so the caller never waits for a thread to start (an unbounded wait on
a loaded machine, under the tier's lock), nor sees a process at its thread limit raise out of
its ``store``, and the end waits for nothing the poller does."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from release_support import assert_nothing_held, held_session
from remote_support import BLOCK_LEN, fake_session, fill_random, free_port, wait_for

from torch_kv_tier import session_ends
from torch_kv_tier.connections import REDIAL_THREAD
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.results import TRANSFER_FAILED
from torch_kv_tier.session_ends import END_THREAD
from torch_kv_tier.transport.base import PollResult

RESULT_TIMEOUT_S = 20.0


@pytest.fixture
def refusing_tier() -> Iterator[tuple[TierManager, str]]:
    """A tier connected to a live host, with one store there done; its transport then refuses
    every write (``write_blocks`` returns ``None``), as it does once UCX's connection to the
    host was reset."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="refused") as tier,
    ):
        peer = tier.connect(server.address)
        fill_random(tier)
        assert tier.store(["before"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        submit = tier.transport.write_blocks
        tier.transport.write_blocks = lambda *args: None  # type: ignore[method-assign]
        yield tier, peer
        tier.transport.write_blocks = submit  # type: ignore[method-assign]


def refuse_first_start(
    name: str, monkeypatch: pytest.MonkeyPatch, *, every: bool = False
) -> threading.Event:
    """The first start of a thread called ``name`` raises, as at the process's thread limit
    (``every``: each start of it); the event is set once one did."""
    start = threading.Thread.start
    refused = threading.Event()

    def refuse_once(thread: threading.Thread) -> None:
        if thread.name == name and (every or not refused.is_set()):
            refused.set()
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse_once)
    return refused


def watch_session_end(
    tier: TierManager, peer: str, monkeypatch: pytest.MonkeyPatch
) -> threading.Event:
    """An event set once the session of ``tier``'s ``peer`` is ended (its ``close`` called)."""
    session = tier._peers[peer].session
    assert session is not None
    ended = threading.Event()
    end = session.close
    monkeypatch.setattr(session, "close", lambda **kw: (ended.set(), end(**kw)))
    return ended


def test_a_refused_store_returns_while_the_thread_ending_its_hosts_session_cannot_start(
    refusing_tier: tuple[TierManager, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (py-spy in in-flight reset runs: a ``store`` sat in ``_lose_peer``
    for 2 s, under the tier's lock): the store whose submission was refused started the
    thread that ends the dropped host's session itself, and waited for it to start. Here that
    start waits on an event: the store must return (its keys failed) while it waits, and once
    the thread starts the session ends and the host is dialled again."""
    tier, peer = refusing_tier
    start = threading.Thread.start
    gate = threading.Event()

    def start_at_gate(thread: threading.Thread) -> None:
        if thread.name == END_THREAD:
            assert gate.wait(timeout=30.0), "the test never opened the gate"
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_at_gate)
    stored: list[object] = []
    caller = threading.Thread(target=lambda: stored.append(tier.store(["after"], [1])))
    start(caller)
    caller.join(timeout=10.0)
    returned = not caller.is_alive()
    gate.set()
    caller.join(timeout=30.0)
    assert returned, "store() waited for the thread that ends the dropped host's session"
    result = stored[0].result(timeout=RESULT_TIMEOUT_S)  # type: ignore[attr-defined]
    assert result.failed == {"after": TRANSFER_FAILED}
    assert wait_for(lambda: tier.peers() == [peer], 15.0), "the host was never dialled again"


def test_a_refused_store_at_the_thread_limit_fails_its_keys_and_the_host_is_dialled_again(
    refusing_tier: tuple[TierManager, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a process at its thread limit made the store whose submission was
    refused raise ``RuntimeError: can't start new thread`` after the host was dropped, and the
    host's session never ended: the host was never dialled again. The store now returns (its
    keys failed); the thread is started again a second later, then the host is dialled."""
    tier, peer = refusing_tier
    refused = refuse_first_start(END_THREAD, monkeypatch)
    monkeypatch.setattr(session_ends, "_RETRY_S", 0.2)
    result = tier.store(["after"], [1]).result(timeout=RESULT_TIMEOUT_S)
    assert result.failed == {"after": TRANSFER_FAILED}
    assert wait_for(refused.is_set, 10.0), "the thread was never started"
    assert wait_for(lambda: tier.peers() == [peer], 15.0), "the host was never dialled again"


def test_close_ends_the_session_of_a_dropped_host_whose_thread_never_started(
    refusing_tier: tuple[TierManager, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread that would end a dropped host's session could not start and ``close`` came
    before the next try: ``close`` ends that session itself (its host is told at once rather
    than holding the session's slots until its lease timeout)."""
    tier, peer = refusing_tier
    session = tier._peers[peer].session
    assert session is not None
    refused = refuse_first_start(END_THREAD, monkeypatch, every=True)
    monkeypatch.setattr(session_ends, "_RETRY_S", 3600.0)
    assert not tier.store(["after"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
    assert wait_for(lambda: refused.is_set() and len(tier._session_ends) == 1, 10.0)
    tier.close()
    assert not session._thread.is_alive(), "close left the dropped host's session running"


def test_close_ends_a_session_whose_thread_could_not_start_after_close_stopped_waiting(
    refusing_tier: tuple[TierManager, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the poller took a dropped host's session and its thread's start was
    slow, then failed (the thread limit), while ``close`` (its wait for the poller over) took
    the sessions left to it: none. The poller handed the session back to a list nobody read
    any more: it was never ended (its host was never told, and keeps the slots of a session
    not ended clean until its --hold-timeout). Once ``close`` has begun, the thread that
    starts the ends (``session_ends``, the poller's job then) ends it itself."""
    tier, peer = refusing_tier
    ended = watch_session_end(tier, peer, monkeypatch)
    start = threading.Thread.start
    starting, gate = threading.Event(), threading.Event()

    def slow_then_refused(thread: threading.Thread) -> None:
        if thread.name == END_THREAD:
            starting.set()
            assert gate.wait(timeout=30.0), "the test never opened the gate"
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_then_refused)
    monkeypatch.setattr(session_ends, "_RETRY_S", 3600.0)
    assert not tier.store(["after"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
    assert starting.wait(timeout=10.0), "the thread was never started"
    tier.close(timeout=0)  # waits 0.1 s for the thread still starting the session's thread
    gate.set()
    assert ended.wait(timeout=15.0), "the dropped host's session was never ended"


def test_close_ends_a_dropped_hosts_session_clean_without_a_session_of_its_own(
    refusing_tier: tuple[TierManager, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``close`` ended a dropped host's session the poller never started
    ending by naming that session itself as resolved over it: the host ended it on reading
    that, the session's disconnect then went unanswered ("the server no longer knows this
    session", logged), and ``close`` opened another session to the host only to name it
    again. It now ends clean (all its writes resolved), told by its own disconnect."""
    tier, peer = refusing_tier
    session = tier._peers[peer].session
    assert session is not None
    own_sessions: list[object] = []
    release_over_own = tier._release_over_own_session
    refused = refuse_first_start(END_THREAD, monkeypatch, every=True)

    def spy(*args: object, **kwargs: object) -> object:
        own_sessions.append(args)
        return release_over_own(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(session_ends, "_RETRY_S", 3600.0)
    monkeypatch.setattr(tier, "_release_over_own_session", spy)
    assert not tier.store(["after"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
    assert wait_for(lambda: refused.is_set() and len(tier._session_ends) == 1, 10.0)
    tier.close()
    assert session.ended_clean, "the host did not answer the session's clean disconnect"
    assert own_sessions == [], "close opened a session of its own to name the dropped one"


def test_a_dropped_hosts_session_ends_while_the_poller_is_busy(
    refusing_tier: tuple[TierManager, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (a 5 s ``transport.poll`` or done-callback: ``session.close`` came
    5.00 s after the drop, 0.02 s before the poller started the ends): the session of a host
    that a refused store dropped ended only once the poller finished its step, so the host
    kept that session's slots, and the redial waited, as long as the poller was busy. Here the
    poller sits in ``transport.poll`` until the test lets it go: the session must end
    meanwhile."""
    tier, peer = refusing_tier
    ended = watch_session_end(tier, peer, monkeypatch)
    poll = tier.transport.poll
    in_poll, release = threading.Event(), threading.Event()

    def held_poll(*args: object) -> PollResult:
        if args:  # a caller's own poll of its transfers: not done (the poller finds them)
            return PollResult((), (), None)
        if threading.current_thread() is tier._thread and not in_poll.is_set():
            in_poll.set()
            assert release.wait(timeout=30.0), "the test never let the poller go"
        return poll()

    monkeypatch.setattr(tier.transport, "poll", held_poll)
    refuse = tier.transport.write_blocks
    del tier.transport.write_blocks  # (the transport's own again, for one store in flight)
    in_flight = tier.store(["in flight"], [2])  # the poller polls it, and is held there
    tier.transport.write_blocks = refuse  # type: ignore[method-assign]
    try:
        assert in_poll.wait(timeout=10.0), "the poller never polled"
        result = tier.store(["after"], [1]).result(timeout=RESULT_TIMEOUT_S)
        assert result.failed == {"after": TRANSFER_FAILED}
        assert ended.wait(timeout=10.0), "the session ended only once the poller was free"
    finally:
        release.set()
    assert in_flight.result(timeout=RESULT_TIMEOUT_S).failed  # (its host was dropped)
    assert wait_for(lambda: tier.peers() == [peer], 15.0), "the host was never dialled again"


def test_a_connect_left_to_the_redialer_never_starts_its_thread_under_the_tiers_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``connect(..., redial_if_down=True)`` of a host that did not answer
    handed it to the redialer under the tier's lock, which started the redialer's thread (the
    tier's first host) there: every store, load and the poller waited on the OS for that
    start. Here the start waits on an event: the tier's lock must be free meanwhile."""
    start = threading.Thread.start
    starting, gate = threading.Event(), threading.Event()

    def start_at_gate(thread: threading.Thread) -> None:
        if thread.name == REDIAL_THREAD and not gate.is_set():
            starting.set()
            assert gate.wait(timeout=30.0), "the test never opened the gate"
        start(thread)

    failures: list[BaseException] = []

    def connect(tier: TierManager) -> None:
        try:
            tier.connect(f"127.0.0.1:{free_port()}", timeout_s=0.2, redial_if_down=True)
        except BaseException as exc:
            failures.append(exc)

    with TierManager.create(16, BLOCK_LEN, name="redial-start") as tier:
        monkeypatch.setattr(threading.Thread, "start", start_at_gate)
        caller = threading.Thread(target=connect, args=(tier,))
        start(caller)
        try:
            assert starting.wait(timeout=10.0), "the redialer's thread was never started"
            free = tier._lock.acquire(timeout=5.0)
            if free:
                tier._lock.release()
        finally:
            gate.set()
            caller.join(timeout=30.0)
        assert free, "the redialer's thread was started under the tier's lock"
        assert [type(exc) for exc in failures] == [TimeoutError]


def test_a_redialer_that_could_not_start_is_started_by_the_tiers_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the process's thread limit the redialer's thread of a host left to it by
    ``connect(..., redial_if_down=True)`` cannot start: the connect still raises the host's
    own failure (``TimeoutError``, never ``RuntimeError``), and the tier's tick
    (``session_ends``, off the tier's lock) starts the redialer about a second later."""
    with TierManager.create(16, BLOCK_LEN, name="redial-limit") as tier:
        refused = refuse_first_start(REDIAL_THREAD, monkeypatch)
        with pytest.raises(TimeoutError):
            tier.connect(f"127.0.0.1:{free_port()}", timeout_s=0.2, redial_if_down=True)
        assert refused.is_set()
        assert wait_for(lambda: tier._redialer._thread is not None, 10.0), "never re-armed"


def test_a_fault_the_poller_read_before_close_took_the_sessions_leaves_the_end_to_close(
    refusing_tier: tuple[TierManager, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the poller reads ``faulted_peers()`` off the lock; a ``close`` that
    took the sessions meanwhile (a store cancelled in flight: its session to end dirty) was
    followed by the poller dropping that host and handing the same session to
    ``session_ends``, whose thread ended it first, clean (the cancelled store was off the
    in-flight table already): the host freed the slots a cancelled write may still land in.
    The session must end once, as ``close`` says: not clean."""
    tier, peer = refusing_tier
    session = tier._peers[peer].session
    assert session is not None
    ends: list[bool] = []
    ended, end = threading.Event(), session.close
    monkeypatch.setattr(
        session, "close", lambda *, clean: (ends.append(clean), ended.set(), end(clean=clean))
    )
    transport, cancelled, read = tier.transport, threading.Event(), threading.Event()
    cancel, faulted = transport.cancel, transport.faulted_peers

    def fault_once_close_took_the_sessions() -> dict[str, str]:
        if threading.current_thread() is not tier._thread:
            return faulted()
        read.set()
        assert cancelled.wait(timeout=30.0), "close never cancelled the store"
        return {peer: "reset"}

    monkeypatch.setattr(transport, "poll", lambda *args: PollResult((), (), None))
    monkeypatch.setattr(transport, "faulted_peers", fault_once_close_took_the_sessions)
    monkeypatch.setattr(transport, "cancel", lambda *a: (cancelled.set(), cancel(*a))[1])
    stop_redialer = tier._redialer.stop  # (the poller is done before close stops the ends)
    monkeypatch.setattr(
        tier._redialer, "stop", lambda timeout: (tier._thread.join(30.0), stop_redialer(timeout))
    )
    del transport.write_blocks  # (the transport's own again: a store in flight)
    in_flight = tier.store(["in flight"], [2])
    assert read.wait(timeout=10.0), "the poller never polled"
    tier.close(timeout=0)
    assert in_flight.result(timeout=RESULT_TIMEOUT_S).failed
    assert ended.wait(timeout=RESULT_TIMEOUT_S), "the session was never ended"
    for thread in threading.enumerate():  # an end started meanwhile has ended too
        if thread.name == END_THREAD:
            thread.join(timeout=30.0)
    assert ends == [False], "the session was ended twice, or clean despite its cancelled write"


def test_a_dropped_session_named_by_closes_last_word_ends_without_a_false_warning(
    refusing_tier: tuple[TierManager, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: a dropped host's session whose end outlasted ``close`` is named
    resolved by ``close``'s last word (``EndedSessions.take``, ``closing``), so its host ends
    it; its own disconnect then hears that the host no longer knows it, which was logged as a
    warning, "disconnect ... got no answer", as if the host held something. Nothing is held:
    that is said at info, as what it is. And a last word that outlasted ``close``'s wait (a
    loaded machine) found the transport closed before its handshake: "could not tell ...
    (NixlTransport ... is closed)", the session left to its own end."""
    tier, peer = refusing_tier
    server_address = tier._dials[peer].address
    session = tier._peers[peer].session
    assert session is not None
    entered, go = threading.Event(), threading.Event()
    end = session.close

    def held_back(**kw: bool) -> None:  # the end outlasts close
        entered.set()
        assert go.wait(RESULT_TIMEOUT_S)
        end(**kw)

    monkeypatch.setattr(session, "close", held_back)
    handshake, closed = tier._open, threading.Event()

    def outlasting_close(*args: Any, **kwargs: Any) -> Any:  # close's last word, past its wait
        if tier.closed:
            assert closed.wait(RESULT_TIMEOUT_S)
        return handshake(*args, **kwargs)

    monkeypatch.setattr(tier, "_open", outlasting_close)
    assert tier.store(["x"], [1]).result(timeout=RESULT_TIMEOUT_S).failed == {"x": TRANSFER_FAILED}
    assert entered.wait(RESULT_TIMEOUT_S)
    caplog.clear()
    tier.close(timeout=0.1)
    closed.set()
    with fake_session(server_address, private=False) as observer:
        gone = wait_for(
            lambda: session.public_id not in {s["public_id"] for s in observer.stats()["sessions"]},
            RESULT_TIMEOUT_S,
        )
        assert gone, "close's last word did not name the dropped session"
    go.set()
    threads = [t for t in threading.enumerate() if t.name == END_THREAD]
    for thread in threads:
        thread.join(timeout=RESULT_TIMEOUT_S)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], warnings
    assert_nothing_held(server_address)


def test_a_release_handed_back_during_a_connects_handshake_goes_out_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a resolved session handed back for a host (a dropped session's end
    whose disconnect went unanswered, a release session that failed) while a connect's
    handshake with that host was under way found no live session to go over, and the
    handshake had taken its list already: it waited for the next event or ``close``, the
    host holding its slots meanwhile. It goes out once the connect's session is published."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="handed-back") as tier,
    ):
        held = held_session(server.address)
        handshake = tier._open
        handed = threading.Event()

        def handed_back_meanwhile(*args: Any, **kwargs: Any) -> Any:
            session = handshake(*args, **kwargs)
            if not handed.is_set():  # as ``_end_counted`` hands back what its end could not tell
                handed.set()
                with tier._lock:
                    tier._ended.give_back(server.address, [held.session_id])
                    if server.address in tier._ended.resolved:
                        tier._send_releases(server.address)
            return session

        monkeypatch.setattr(tier, "_open", handed_back_meanwhile)
        tier.connect(server.address)
        assert handed.is_set()
        assert_nothing_held(server.address)
