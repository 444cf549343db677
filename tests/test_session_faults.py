"""A tier's session with a host that freezes, restarts or is slow: what the host hands the
session (a grant, even one answered late) is never given for nothing; a session closed from any
thread (its own answer callbacks included), or one that cannot start, ends on the host, clean
and not called lost; a paused tier asks its host before calling it lost. What the tier tells a
host of its ended sessions is ``test_session_releases``."""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
from remote_support import BLOCK_LEN, fake_session, fill_random, free_port, wait_for

from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess, session_io
from torch_kv_tier.remote import client as client_module
from torch_kv_tier.remote import handshake as handshake_module
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.shared_host import SharedHost

RESULT_TIMEOUT_S = 20.0


def test_a_grant_answered_after_its_timeout_still_brings_its_slots() -> None:
    """A grant request that timed out (a host frozen for longer than the request timeout,
    shorter than the heartbeat timeout) was answered late: the host counted those slots as
    granted to the session, the tier never learnt them. Once the session's share of granted
    slots (``--max-grant``) was spent so, every grant came back empty and every store failed
    "capacity" for as long as the session lived."""
    with (
        ServerProcess.start(64, BLOCK_LEN, extra_args=["--max-grant", "4"]) as server,
        TierManager.create(16, BLOCK_LEN, name="late-grant", grant_batch=4) as tier,
    ):
        tier.connect(server.address, timeout_s=1.0)
        (host,) = tier._peers.values()
        assert isinstance(host, SharedHost)
        assert wait_for(lambda: len(host.grants) == 4 and not host.refilling, 5.0)
        stop_process(server.proc.pid)
        try:
            with tier._lock:  # as a store does once its writes completed: commit, top up
                slots = list(host.grants)
                host.grants.clear()
                host.commit([f"written-{i}" for i in range(4)], slots, [0] * 4)
                tier._refill(host)
            time.sleep(2.5)  # the top-up times out (1 s) and is asked again
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        fill_random(tier)
        stored = tier.store(["a", "b"], range(2)).result(timeout=RESULT_TIMEOUT_S)
        assert stored.ok, stored.failed


def test_a_session_answers_a_late_grant_once_and_forgets_requests_the_host_skipped() -> None:
    """At the session: a grant's answer after its timeout runs ``on_answer`` again (once, with
    that answer); a request the host answered nothing to by the time it answered a later one
    never will be (answers come in order), and is forgotten."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False, timeout_s=0.5)
        answers: list[Future[p.ServerMessage]] = []
        try:
            stop_process(server.proc.pid)
            try:
                session.grant(2, answers.append)
                assert wait_for(lambda: len(answers) == 1, 5.0)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert isinstance(answers[0].exception(timeout=0), TimeoutError)
            assert wait_for(lambda: len(answers) == 2, 5.0), "the late answer never came"
            late = answers[1].result(timeout=0)
            assert isinstance(late, p.Granted) and len(late.slots) == 2
            assert session.stats()["shared_granted_blocks"] == 2
            time.sleep(0.2)
            assert len(answers) == 2
        finally:
            session.close()


def test_a_host_restarted_between_hello_and_handshake_is_greeted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ``Handshake`` reached a host restarted at the same address since it answered the
    ``Hello`` (or, after a reset, the same host under a new connection): it refused the nonce
    as stale, and the tier took that for a refusal (vLLM fails to start on one). The client
    starts again with a ``Hello``, within its deadline."""
    port = free_port()
    args = ["--port", str(port), "--host-id", "restarted"]
    servers = [ServerProcess.start(8, BLOCK_LEN, extra_args=args)]
    expect = handshake_module._expect

    def restart_after_the_challenge(*args_: Any) -> Any:
        reply = expect(*args_)
        if isinstance(reply, p.Challenge) and len(servers) == 1:
            servers[0].stop()
            servers.append(ServerProcess.start(8, BLOCK_LEN, extra_args=args))
        return reply

    monkeypatch.setattr(handshake_module, "_expect", restart_after_the_challenge)
    try:
        with fake_session(f"127.0.0.1:{port}", slots=4, timeout_s=30.0) as session:
            assert session.peer_id == "restarted" and len(session.lease) == 4
            time.sleep(0.5)  # the old connection's end is no loss of this session
            assert session.lost is None
        assert len(servers) == 2
    finally:
        for server in servers:
            server.stop()


def test_a_session_closed_from_its_own_answer_callback_still_disconnects() -> None:
    """``close`` on the session's I/O thread (an answer callback) sent no ``Disconnect``: the
    host kept the session until its lease timeout, then held its grants as if a write of it
    could still land, until a release that never comes."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False)
        closed = threading.Event()

        def close_here(_answer: Future[p.ServerMessage]) -> None:
            session.close()
            closed.set()

        session.grant(2, close_here)
        assert closed.wait(10)
        with fake_session(server.address, private=False) as observer:
            assert wait_for(lambda: len(observer.stats()["sessions"]) == 1, 5.0)
            stats = observer.stats()
            assert stats["held_sessions"] == 0 and stats["shared_granted_blocks"] == 0, stats


def test_stats_asked_from_an_answer_callback_fails_at_once_and_the_session_lives() -> None:
    """``stats`` waits for its answer, which only the session's I/O thread receives: asked from
    an answer callback (on that thread) it blocked the thread until its own timeout, with no
    heartbeat meanwhile (past the heartbeat timeout the session was lost), then raised
    ``TimeoutError``. It raises ``RuntimeError`` at once, saying to ask from another thread."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False, timeout_s=1.0)
        raised: Future[BaseException | None] = Future()

        def stats_here(_answer: Future[p.ServerMessage]) -> None:
            try:
                session.stats()
            except BaseException as exc:
                raised.set_result(exc)
            else:
                raised.set_result(None)

        try:
            session.grant(2, stats_here)
            error = raised.result(timeout=RESULT_TIMEOUT_S)
            assert isinstance(error, RuntimeError) and "another thread" in str(error), error
            assert session.lost is None and session.stats()["sessions"]
        finally:
            session.close()


def test_a_session_closed_from_its_callback_while_its_host_is_slow_still_ends_clean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close`` on the I/O thread sent the ``Disconnect`` and closed the socket at once, its
    answer unawaited: a host slower than that (a loaded machine; here frozen) read the request
    before it only once the connection had closed, could not route that request's answer, and
    ended the session as if a write of it could still land: its grants held until a release
    that never comes."""
    monkeypatch.setattr(client_module, "_DISCONNECT_TIMEOUT_S", 30.0)  # not this test's subject
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False)
        closed = threading.Event()

        def close_here(_answer: Future[p.ServerMessage]) -> None:
            stop_process(server.proc.pid)  # the host is slow from here on
            session.grant(1, lambda _later: None)  # a request the host reads after this
            session.close()
            closed.set()

        session.grant(2, close_here)
        try:
            assert closed.wait(10)
            time.sleep(0.5)  # the session's last frames reach the host's socket meanwhile
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: not session._thread.is_alive(), 10.0), "its I/O thread runs on"
        with fake_session(server.address, private=False) as observer:
            assert wait_for(lambda: len(observer.stats()["sessions"]) == 1, 5.0)
            stats = observer.stats()
            assert stats["held_sessions"] == 0 and stats["shared_granted_blocks"] == 0, stats


def test_a_session_closed_from_its_callback_stops_when_its_host_never_answers() -> None:
    """The bound of that wait: a closed session whose host does not answer its ``Disconnect``
    (frozen) stops its I/O thread and closes its connection after the session's timeout; the
    host then ends the session by its own rules."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        session = fake_session(server.address, private=False, timeout_s=1.0)
        closed = threading.Event()

        def close_here(_answer: Future[p.ServerMessage]) -> None:
            stop_process(server.proc.pid)
            session.close()
            closed.set()

        session.grant(2, close_here)
        try:
            assert closed.wait(10)
            assert wait_for(lambda: not session._thread.is_alive(), 5.0), "it waits on"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)


def test_a_session_that_cannot_start_after_its_accept_is_ended_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host accepted, then the session could not start here (no file descriptor left for
    its wake-up pair, or no thread): ``open`` raised, and the host kept the session and its
    lease until its lease timeout, then held them as if a write of it could still land."""

    def no_descriptor_left() -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    with ServerProcess.start(16, BLOCK_LEN) as server:
        monkeypatch.setattr(socket, "socketpair", no_descriptor_left)
        with pytest.raises(OSError, match="Too many open files"):
            fake_session(server.address, slots=8)
        monkeypatch.undo()
        with fake_session(server.address, slots=4) as observer:
            assert wait_for(lambda: len(observer.stats()["sessions"]) == 1, 5.0)
            stats = observer.stats()
            assert stats["leased_blocks"] == 4 and stats["held_blocks"] == 0, stats


def test_a_tier_paused_past_its_heartbeat_timeout_asks_the_host_before_calling_it_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tier process paused (SIGSTOP, a debugger, a VM migrated) for longer than its heartbeat
    timeout, shorter than the host's lease timeout, called the host lost as it came back,
    without asking it: it dropped the host and every key it had there, and dialled it again.
    The host had answered every heartbeat it was sent; silence counts from a heartbeat."""
    paused = [0.0]

    class Clock:  # the I/O thread's clock, which a pause moves on at once
        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + paused[0]

    monkeypatch.setattr(session_io, "time", Clock)
    with ServerProcess.start(16, BLOCK_LEN) as server:
        session = fake_session(server.address, slots=4, heartbeat_timeout_s=3.0)
        try:
            time.sleep(0.5)
            paused[0] = 5.0
            session._wake()
            time.sleep(1.5)  # a heartbeat goes out and is answered
            assert session.lost is None
            assert len(session.stats()["sessions"]) == 1
        finally:
            session.close()


def test_a_session_closed_while_its_host_is_slow_is_not_called_lost() -> None:
    """Heartbeats went on after the ``Disconnect``: a host that read them after it (frozen,
    then resumed) answered each that it no longer knew the session, and a session closed clean
    called itself lost ("the server no longer knows this session")."""
    with ServerProcess.start(16, BLOCK_LEN) as server:
        session = fake_session(server.address, slots=4, heartbeat_interval_s=0.05)
        sent: list[p.ClientMessage] = []
        send = session._send

        def record(sock: Any, message: p.ClientMessage) -> None:
            sent.append(message)
            send(sock, message)

        session._send = record  # type: ignore[method-assign]  # (the I/O thread's)
        stop_process(server.proc.pid)
        try:
            closing = threading.Thread(target=session.close, daemon=True)
            closing.start()
            time.sleep(1.0)  # heartbeats are due meanwhile
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        closing.join(timeout=RESULT_TIMEOUT_S)
        assert not closing.is_alive()
        kinds = [type(m).__name__ for m in sent]
        assert "Heartbeat" not in kinds[kinds.index("Disconnect") :], kinds
        assert session.lost is None, session.lost
        with fake_session(server.address, slots=4) as observer:
            stats = observer.stats()
            assert stats["held_sessions"] == 0 and len(stats["sessions"]) == 1, stats


def test_a_session_closed_as_its_heartbeat_falls_due_sends_none_after_its_disconnect() -> None:
    """The I/O thread read whether to beat before it waited: a ``close`` that woke it as a
    heartbeat fell due (another thread's, more likely on a loaded machine, or a callback's on
    it) had its ``Disconnect`` sent, then the heartbeat, which the host answered that it no
    longer knew the session: a session closed clean called itself lost."""
    with (
        ServerProcess.start(16, BLOCK_LEN) as server,
        fake_session(server.address, slots=4, heartbeat_interval_s=0.05) as session,
    ):
        sent: list[p.ClientMessage] = []
        send = session._send

        def record(sock: Any, message: p.ClientMessage) -> None:
            sent.append(message)
            send(sock, message)

        def close_once_a_heartbeat_is_due() -> None:  # (the I/O thread, within a wake-up)
            time.sleep(session._interval_s)  # the next heartbeat's deadline passes
            session.close()  # (on the I/O thread: queues the Disconnect, returns at once)

        session._send = record  # type: ignore[method-assign]  # (the I/O thread's)
        session._enqueue_action(close_once_a_heartbeat_is_due)
        session._thread.join(timeout=RESULT_TIMEOUT_S)
        assert not session._thread.is_alive()
        kinds = [type(m).__name__ for m in sent]
        assert "Heartbeat" not in kinds[kinds.index("Disconnect") :], kinds
        assert session.ended_clean and session.lost is None, session.lost


def test_a_tier_closed_while_a_host_sends_its_index_ends_that_connect_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # close ends a joining host's session clean, so the join's wait for the host's index saw
    # no loss and waited out its whole timeout_s, then blamed the host ("did not send its
    # index"). It now stops at close and says the tier is closed.
    from torch_kv_tier import shared_hosts

    following = threading.Event()  # the join waits for the host's index

    class NoIndex(shared_hosts._HostChanges):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            following.set()

        def __call__(self, *args: Any) -> None:  # the host's snapshot never completes here
            pass

    monkeypatch.setattr(shared_hosts, "_HostChanges", NoIndex)
    with ServerProcess.start(64, BLOCK_LEN) as server:
        tier = TierManager.create(num_blocks=8, block_len=BLOCK_LEN)
        outcome: list[BaseException] = []

        def join() -> None:
            try:
                tier.connect(server.address, timeout_s=60.0)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=join)
        thread.start()
        try:
            assert wait_for(lambda: following.is_set() or bool(outcome), 30.0)
        finally:
            tier.close()
        thread.join(timeout=10.0)
        assert not thread.is_alive()
        assert len(outcome) == 1 and "closed" in str(outcome[0]), outcome


def test_a_handshake_the_host_cannot_decode_is_rejected_at_once_with_its_reason() -> None:
    """A ``Handshake`` the host cannot decode (a version skew or a bug: here a field of the
    wrong type) is answered with the host's ``Error`` of seq 0, the one answer a frame it could
    not read gets: the client raised ``AcceptLost`` at its deadline instead, as if no answer
    came, and a tier would release a session that never opened."""
    with ServerProcess.start(32, BLOCK_LEN) as server:
        sock, monitor = handshake_module.connect(server.address)
        try:
            request = p.Handshake(
                p.PROTOCOL_VERSION, 2, b"", b"", b"x", p.Region(0x10000, 8, BLOCK_LEN), "",
                None, client_name=5,  # type: ignore[arg-type]
            )  # fmt: skip
            deadline = time.monotonic() + 5.0
            with pytest.raises(handshake_module.HandshakeRejected) as rejected:
                handshake_module.handshake(sock, server.address, deadline, None, request)
        finally:
            handshake_module.close_sockets(sock, monitor)
    assert rejected.value.reason.startswith("malformed frame"), rejected.value.reason
    assert "client_name" in rejected.value.reason
