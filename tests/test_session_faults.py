"""A tier's session with a host that freezes, restarts or loses frames: what the host hands the
session is never given for nothing, and what the tier tells it is never lost with a session."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import pytest
from remote_support import BLOCK_LEN, control_ports, fake_session, fill_random, free_port, wait_for

from torch_kv_tier import connections, session_releases
from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.connections import Dial
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import RemoteSession, ServerProcess, session_io
from torch_kv_tier.remote import client as client_module
from torch_kv_tier.remote import handshake as handshake_module
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.shared_host import SharedHost

RESULT_TIMEOUT_S = 20.0


def _held_session(address: str) -> RemoteSession:
    """A shared session at ``address`` granted 2 slots and ended unclean, as if a write of it
    could still land: the host holds it until it is named resolved."""
    session = fake_session(address, private=False)
    granted: Future[Future[p.ServerMessage]] = Future()
    session.grant(2, granted.set_result)
    assert isinstance(granted.result(timeout=10).result(), p.Granted)
    session.close(clean=False)
    return session


@contextmanager
def _connected_beside_a_held_session(
    name: str,
) -> Iterator[tuple[ServerProcess, TierManager, RemoteSession, str, RemoteSession]]:
    """A host holding one ended session (``_held_session``) and a tier connected to it: the
    host, the tier, the held session, the host's peer id and the tier's session."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name=name) as tier,
    ):
        held = _held_session(server.address)
        peer = tier.connect(server.address)
        session = tier._peers[peer].session
        assert session is not None
        yield server, tier, held, peer, session


def _assert_nothing_held(address: str) -> None:
    """The host at ``address`` holds no ended session's slots (within 10 s)."""
    with fake_session(address, private=False) as observer:
        held = wait_for(lambda: observer.stats()["held_sessions"] == 0, 10.0)
        assert held, observer.stats()["held_sessions"]


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


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to reset a connection")
def test_a_release_lost_with_its_session_is_told_again() -> None:
    """A ``Release`` (ended sessions whose writes all resolved) went out on a session whose
    control connection was then reset before the host read it (a frozen host, a NAT): the
    tier had forgotten those sessions, and the host held their slots for good."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="releases") as tier,
    ):
        peer = tier.connect(server.address)
        held = _held_session(server.address)
        (host,) = tier._peers.values()
        ports = control_ports(server)
        stop_process(server.proc.pid)
        try:
            for i in range(40):  # fill the connection's buffers: what follows stays queued
                host.session.touch([b"%06d-" % i + b"k" * 50 + b"%06d" % j for j in range(8192)])
            time.sleep(0.5)
            with tier._lock:  # the tier learnt that every write of ``held`` resolved
                tier._ended.give_back(server.address, [held.session_id])
                tier._send_releases(server.address)
            time.sleep(0.2)
            for port in ports:  # as a NAT does
                subprocess.run(
                    ["ss", "-K", "src", f"127.0.0.1:{port}"], check=True, capture_output=True
                )
            assert wait_for(lambda: host.session.lost is not None, 5.0)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: tier.peers() == [peer], 15.0), "the tier never came back"
        _assert_nothing_held(server.address)


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


def test_a_release_sent_over_a_join_that_failed_is_told_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``Release`` went out on a session still joining (its host froze before it sent its
    index), and the join failed: its session ended with its disconnect unanswered, so the host
    may never have read the ``Release``, but the tier forgot those sessions and the host held
    their slots for good."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="failed-join") as tier,
    ):
        held = _held_session(server.address)
        follow = RemoteSession.follow

        def freeze_then_follow(session: RemoteSession, on_change: Any) -> None:
            # (the tier's lock held, the joining host published) the host freezes before it
            # answers the snapshot; what the session sends from now on stays queued
            stop_process(server.proc.pid)
            for i in range(40):
                session.touch([b"%06d-" % i + b"k" * 50 + b"%06d" % j for j in range(8192)])
            time.sleep(0.5)
            tier._ended.give_back(server.address, [held.session_id])
            tier._send_releases(server.address)  # over the joining session
            follow(session, on_change)

        monkeypatch.setattr(RemoteSession, "follow", freeze_then_follow)
        try:
            with pytest.raises(TimeoutError):
                tier.connect(server.address, timeout_s=1.0)
            time.sleep(1.5)  # past the closed socket's linger: its queued frames are dropped
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        monkeypatch.undo()
        tier.connect(server.address)
        _assert_nothing_held(server.address)


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


def test_sessions_resolved_for_a_host_the_tier_does_not_dial_are_kept_for_its_next_connect() -> (
    None
):
    """A session ended with a write in flight at an address the tier neither has a session
    with nor dials (the first connect there failed while a store to it was in flight), and
    the write then resolved: the tier took the session to release and, finding nowhere to
    send it, forgot it; the host held its slots for good, though the user connected there
    again. It waits for the next handshake there."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="undialled") as tier,
    ):
        ended = _held_session(server.address)
        with tier._lock:  # as the transport reports that write (``transfers``)
            tier._ended.ended(ended, 1)
            assert tier._ended.write_resolved(ended)
            tier._send_releases(server.address)
        tier.connect(server.address)
        _assert_nothing_held(server.address)


def test_a_closing_tier_names_the_resolved_sessions_of_a_host_it_has_no_session_with() -> None:
    """``close`` ends with a handshake of its own to each host it holds resolved sessions of
    but has no live session with (lost and not dialled again yet, or removed): that handshake
    started with the tier's closing already set, which cancels every handshake at once, so it
    never went out, and the host held those sessions' slots for good."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        held = _held_session(server.address)
        tier = TierManager.create(16, BLOCK_LEN, name="last-word")
        with tier._lock:  # as a lost host that is not dialled again yet leaves them
            tier._dials["lost-host"] = Dial(server.address, None, False, None, 10.0, 10.0)
            tier._ended.give_back(server.address, [held.session_id])
        tier.close()
        _assert_nothing_held(server.address)


def test_a_connected_host_replaced_by_add_peer_keeps_the_releases_its_session_carried() -> None:
    """``add_peer`` under a connected host's id ended that host's session as ``end_session``
    does, without keeping what it had released: a ``Release`` its host never read (frozen, the
    disconnect unanswered, the frames dropped with the connection) was forgotten, and the host
    held those sessions' slots for good."""
    with _connected_beside_a_held_session("replaced") as (server, tier, held, peer, session):
        stop_process(server.proc.pid)
        try:
            for i in range(40):  # fill the connection's buffers: what follows stays queued
                session.touch([b"%06d-" % i + b"k" * 50 + b"%06d" % j for j in range(8192)])
            time.sleep(0.5)
            with tier._lock:  # the tier learnt that every write of ``held`` resolved
                tier._ended.give_back(server.address, [held.session_id])
                tier._send_releases(server.address)  # over the live session
            region = (session.agent_metadata, session.base_addr, 8, session.block_len)
            adding = threading.Thread(target=tier.add_peer, args=(peer, *region), daemon=True)
            adding.start()  # ends the session: its disconnect goes unanswered
            assert wait_for(lambda: not session._thread.is_alive(), 10.0)
            time.sleep(1.5)  # past the closed socket's linger: its queued frames are dropped
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        adding.join(timeout=RESULT_TIMEOUT_S)
        assert not adding.is_alive() and tier.peers() == [peer]
        tier.close()  # names every session it ended
        _assert_nothing_held(server.address)


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


def test_a_host_disconnected_clean_is_not_sent_a_release_of_that_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``disconnect`` of a healthy host named its session, which the host had just ended clean
    (it answered the ``Disconnect``), as one to release: every disconnect opened a second
    session, handshake and all, only to release the first (a thread of its own that, for a host
    that went silent meanwhile, retried for ``RELEASE_BUDGET_S``)."""
    told: list[dict[str, list[str]]] = []
    send_releases = TierManager._send_releases

    def record(self: TierManager, address: str) -> None:
        told.append({a: list(ids) for a, ids in self._ended.resolved.items()})
        send_releases(self, address)

    monkeypatch.setattr(TierManager, "_send_releases", record)
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="clean-bye") as tier,
    ):
        tier.disconnect(tier.connect(server.address))
        assert told == [{}], told


def test_releases_close_makes_over_a_session_lost_meanwhile_still_reach_the_host() -> None:
    """``close`` names the resolved sessions of each host over its live session; one lost just
    then (its connection reset as ``close`` began) refused them, and they were dropped with a
    log line: the host held their slots for good. They go over a session of their own."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        held = _held_session(server.address)
        tier = TierManager.create(16, BLOCK_LEN, name="lost-at-close")
        peer = tier.connect(server.address)
        session = tier._peers[peer].session
        assert session is not None
        end_sessions = tier._end_sessions

        def reset() -> None:
            raise session_io._Lost("the control connection was closed or reset")

        def lost_first(ending: list[tuple[Any, bool]], timeout_s: float) -> None:
            session._enqueue_action(reset)  # the I/O thread ends the session as a reset does
            assert wait_for(lambda: session.lost is not None, 5.0)
            end_sessions(ending, timeout_s)

        tier._end_sessions = lost_first  # type: ignore[method-assign]
        with tier._lock:  # the tier learnt that every write of ``held`` resolved
            tier._ended.give_back(server.address, [held.session_id])
        tier.close()
        _assert_nothing_held(server.address)


def test_a_release_under_way_as_the_tier_closes_is_still_told() -> None:
    """A removed host's resolved sessions go over a session of their own, on a thread; a
    ``close`` while that handshake awaited the host (frozen) cancelled it, and the thread gave
    them back after ``close`` had looked for what to name: nobody named them, and the host
    held their slots for good. The thread makes ``close``'s last word itself."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        held = _held_session(server.address)
        tier = TierManager.create(16, BLOCK_LEN, name="closed-mid-release")
        peer = tier.connect(server.address)
        stop_process(server.proc.pid)
        try:
            with tier._lock:  # the tier learnt that every write of ``held`` resolved
                tier._ended.give_back(server.address, [held.session_id])
            tier.remove_peer(peer)  # its handshake awaits the frozen host
            assert any(t.name == session_releases.RELEASE_THREAD for t in threading.enumerate())
            closing = threading.Thread(target=tier.close, daemon=True)
            closing.start()
            time.sleep(0.5)  # the handshake sees ``close`` (it looks every CANCEL_POLL_S)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)  # in time for ``close``'s last word
        closing.join(timeout=RESULT_TIMEOUT_S)
        assert not closing.is_alive()
        _assert_nothing_held(server.address)


def test_releases_a_lost_session_gives_back_after_its_host_was_removed_still_go_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lost session's end hands back the releases it carried that its host may not have
    read; when the user removed the host meanwhile (a fleet dropping a host as it dies), the
    removal had already released and forgotten it: they were kept for an address nobody
    dials, not even ``close``, and the host held those sessions' slots for good."""
    with _connected_beside_a_held_session("removed-while-ending") as setup:
        server, tier, held, peer, session = setup
        session.unreleased = lambda: [held.session_id]  # type: ignore[method-assign]
        ending, end = threading.Event(), session_releases.end_session

        def slow_end(*args: Any) -> list[str]:
            ending.wait(timeout=RESULT_TIMEOUT_S)
            return end(*args)

        monkeypatch.setattr(session_releases, "end_session", slow_end)
        with tier._lock:  # as a failed transfer does: the session ends on a thread of its own
            tier._lose_peer(peer, "failed a transfer")
        tier.remove_peer(peer)
        ending.set()
        _assert_nothing_held(server.address)


def test_releases_a_session_ended_on_its_own_thread_hands_back_during_close_still_go_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session ended on a thread of its own (a failed transfer dropped its host) hands back
    the releases it carried that its host may not have read (a frozen host leaves its
    disconnect unanswered ~2 s). ``close`` meanwhile named what it found and returned; they
    came back after it and nobody named them: the host held those sessions' slots for good.
    ``close`` waits for such an end, and one that ends after ``close`` names them itself."""
    with _connected_beside_a_held_session("closed-mid-end") as setup:
        server, tier, held, peer, session = setup
        session.unreleased = lambda: [held.session_id]  # type: ignore[method-assign]
        ending, end = threading.Event(), session_releases.end_session

        def slow_end(*args: Any) -> list[str]:  # as a frozen host's unanswered disconnect
            ending.wait(timeout=RESULT_TIMEOUT_S)
            return end(*args)

        monkeypatch.setattr(session_releases, "end_session", slow_end)
        with tier._lock:  # as a failed transfer does: the session ends on a thread of its own
            tier._lose_peer(peer, "failed a transfer")
        closing = threading.Thread(target=tier.close, daemon=True)
        closing.start()
        wait_for(lambda: not closing.is_alive(), 1.0)  # (returns at once, unfixed)
        ending.set()
        closing.join(timeout=RESULT_TIMEOUT_S)
        assert not closing.is_alive()
        _assert_nothing_held(server.address)


def test_a_tier_closed_while_a_host_sends_its_index_ends_that_connect_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # close ends a joining host's session clean, so the join's wait for the host's index saw
    # no loss and waited out its whole timeout_s, then blamed the host ("did not send its
    # index"). It now stops at close and says the tier is closed.
    from torch_kv_tier import shared_hosts

    class NoIndex(shared_hosts._HostChanges):
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
            assert wait_for(lambda: len(tier.peers()) == 1 or bool(outcome), 30.0)
        finally:
            tier.close()
        thread.join(timeout=10.0)
        assert not thread.is_alive()
        assert len(outcome) == 1 and "closed" in str(outcome[0]), outcome


def test_a_session_a_host_down_at_its_connect_may_have_opened_is_named_at_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host that answered a ``connect(..., redial_if_down=True)`` and then nothing (its
    Accept lost, or frozen) may have opened a session, which it holds for good until it is
    named: ``close``, while the tier still dials the host, must name it in its last word (it
    looked only at connected and removed hosts, so a host never joined was not told)."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 30.0)  # no redial meanwhile
    opened = "ab" * p.NONCE_BYTES
    told: list[list[str]] = []

    def accept_lost_then_down(cls: Any, address: str, **kwargs: Any) -> Any:
        told.append(list(kwargs["release"]))
        if len(told) == 1:
            raise handshake_module.AcceptLost(address, opened)
        raise TimeoutError(f"nothing answered at {address}")

    monkeypatch.setattr(RemoteSession, "open", classmethod(accept_lost_then_down))
    address = f"127.0.0.1:{free_port()}"
    tier = TierManager.create(16, BLOCK_LEN, name="accept-lost-pending")
    try:
        with pytest.raises(TimeoutError):
            tier.connect(address, private=True, timeout_s=0.5, redial_if_down=True)
    finally:
        tier.close()
    assert told == [[], [opened]], told
