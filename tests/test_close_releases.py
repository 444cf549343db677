"""``close``'s last word (``session_releases``): a closing tier names to each host the ended
sessions whose writes all resolved, over its live session or a session of its own, whatever
was under way as it closed (a release, a session's end, a connect), and says once for all hosts
what it could not tell. The releases of a live tier are ``test_session_releases``."""

from __future__ import annotations

import os
import signal
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
from remote_support import BLOCK_LEN, SilentHosts, free_port, wait_for

from torch_kv_tier import connections, session_releases
from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.connections import Dial
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import RemoteSession, ServerProcess, session_io
from torch_kv_tier.remote import handshake as handshake_module
from torch_kv_tier.remote import protocol as p


def test_a_closing_tier_names_the_resolved_sessions_of_a_host_it_has_no_session_with() -> None:
    """``close`` ends with a handshake of its own to each host it holds resolved sessions of
    but has no live session with (lost and not dialled again yet, or removed): that handshake
    started with the tier's closing already set, which cancels every handshake at once, so it
    never went out, and the host held those sessions' slots for good."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        held = held_session(server.address)
        tier = TierManager.create(16, BLOCK_LEN, name="last-word")
        with tier._lock:  # as a lost host that is not dialled again yet leaves them
            tier._dials["lost-host"] = Dial(server.address, None, False, None, 10.0, 10.0)
            tier._ended.give_back(server.address, [held.session_id])
        tier.close()
        assert_nothing_held(server.address)


def test_releases_close_makes_over_a_session_lost_meanwhile_still_reach_the_host() -> None:
    """``close`` names the resolved sessions of each host over its live session; one lost just
    then (its connection reset as ``close`` began) refused them, and they were dropped with a
    log line: the host held their slots for good. They go over a session of their own."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        held = held_session(server.address)
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
        assert_nothing_held(server.address)


def test_a_release_under_way_as_the_tier_closes_is_still_told() -> None:
    """A removed host's resolved sessions go over a session of their own, on a thread; a
    ``close`` while that handshake awaited the host (frozen) cancelled it, and the thread gave
    them back after ``close`` had looked for what to name: nobody named them, and the host
    held their slots for good. The thread makes ``close``'s last word itself."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        held = held_session(server.address)
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
        assert_nothing_held(server.address)


def test_releases_a_session_ended_on_its_own_thread_hands_back_during_close_still_go_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session ended on a thread of its own (a failed transfer dropped its host) hands back
    the releases it carried that its host may not have read (a frozen host leaves its
    disconnect unanswered ~2 s). ``close`` meanwhile named what it found and returned; they
    came back after it and nobody named them: the host held those sessions' slots for good.
    ``close`` waits for such an end, and one that ends after ``close`` names them itself."""
    with connected_beside_a_held_session("closed-mid-end") as setup:
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
        assert_nothing_held(server.address)


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


def test_close_says_once_for_all_hosts_what_it_could_not_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``close``'s last word to hosts it knew with ended sessions to name, none of which
    answers (dead, or restarted elsewhere): one warning with their count, not one per host
    (40 lines for a tier that followed 40 host restarts); each host's reason at debug."""
    silent = SilentHosts(3)
    tier = TierManager.create(16, BLOCK_LEN, name="last-words")
    try:
        with tier._lock:
            for i, address in enumerate(silent.addresses):
                tier._removed[address] = Dial(address, None, False, None, 0.3, 10.0)
                tier._ended.give_back(address, [f"ended-{i}"])
        with caplog.at_level("DEBUG", logger=session_releases.__name__):
            tier.close(timeout=5.0)
    finally:
        tier.close()
        silent.close()
    records = [r for r in caplog.records if r.name == session_releases.__name__]
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "could not tell 3 host(s)" in warnings[0] and "3 ended sessions" in warnings[0]
    details = [r.getMessage() for r in records if r.levelname == "DEBUG"]
    assert sorted(d.split()[3] for d in details if "could not tell" in d) == sorted(
        silent.addresses
    )
