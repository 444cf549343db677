"""Releases (``session_releases``): a tier names to each host the ended sessions whose writes
all resolved, so that the host frees their slots. What the tier tells a host is never lost with
a session: a release over a session lost, reset, replaced, removed, ended on a thread of its own
or never joined, or one under way as the tier closes, is told again (over the next session there
or in ``close``'s last word), and a session ended clean is not released at all. The host holds
no ended session's slots for good. A session's own faults are ``test_session_faults``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
from release_support import (
    RESULT_TIMEOUT_S,
    assert_nothing_held,
    connected_beside_a_held_session,
    held_session,
)
from remote_support import BLOCK_LEN, control_ports, wait_for

from torch_kv_tier import session_releases
from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import RemoteSession, ServerProcess


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
        held = held_session(server.address)
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
        assert_nothing_held(server.address)


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
        held = held_session(server.address)
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
        assert_nothing_held(server.address)


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
        ended = held_session(server.address)
        with tier._lock:  # as the transport reports that write (``transfers``)
            tier._ended.ended(ended, 1)
            assert tier._ended.write_resolved(ended)
            tier._send_releases(server.address)
        tier.connect(server.address)
        assert_nothing_held(server.address)


def test_a_connected_host_replaced_by_add_peer_keeps_the_releases_its_session_carried() -> None:
    """``add_peer`` under a connected host's id ended that host's session as ``end_session``
    does, without keeping what it had released: a ``Release`` its host never read (frozen, the
    disconnect unanswered, the frames dropped with the connection) was forgotten, and the host
    held those sessions' slots for good."""
    with connected_beside_a_held_session("replaced") as (server, tier, held, peer, session):
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
        assert_nothing_held(server.address)


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


def test_releases_a_lost_session_gives_back_after_its_host_was_removed_still_go_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lost session's end hands back the releases it carried that its host may not have
    read; when the user removed the host meanwhile (a fleet dropping a host as it dies), the
    removal had already released and forgotten it: they were kept for an address nobody
    dials, not even ``close``, and the host held those sessions' slots for good."""
    with connected_beside_a_held_session("removed-while-ending") as setup:
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
        assert_nothing_held(server.address)


def _threads_named(name: str) -> list[threading.Thread]:
    """The live threads called ``name``."""
    return [t for t in threading.enumerate() if t.name == name]


def test_releases_a_lost_session_whose_end_began_after_its_host_was_removed_still_go_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a loaded CI run: as above, but the thread ending the lost session ran only
    after the removal and its release of that session were done (a busy machine). The removal
    had forgotten how the host was dialled; the end's releases were kept for an address nobody
    dials, and the host held those sessions' slots for good. A dropped session's end counts
    from the drop, so the removal keeps how the host was dialled for it."""
    begin, end_dropped = threading.Event(), TierManager._end_dropped

    def late_end(tier: TierManager, session: Any, clean: bool) -> None:
        begin.wait(timeout=RESULT_TIMEOUT_S)
        end_dropped(tier, session, clean)

    monkeypatch.setattr(TierManager, "_end_dropped", late_end)
    with connected_beside_a_held_session("removed-before-ending") as setup:
        server, tier, held, peer, session = setup
        session.unreleased = lambda: [held.session_id]  # type: ignore[method-assign]
        with tier._lock:  # as a failed transfer does: the session ends on a thread of its own
            tier._lose_peer(peer, "failed a transfer")
        tier.remove_peer(peer)
        # the removal's release (of the lost session, resolved) is done
        assert wait_for(lambda: not _threads_named(session_releases.RELEASE_THREAD), 10.0)
        begin.set()
        assert_nothing_held(server.address)
