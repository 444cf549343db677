"""A Ctrl-C as ``TierManager.close`` waits for the transfers in flight: the tier is closed all
the same (its transfers cancelled, their keys failed, the transport closed, the poller stopped),
and the interrupt still reaches the caller; so too a Ctrl-C in its later waits (the poller's
join, the redialer's and the session ends' stop, the release threads): the sessions still end
and the transport still closes. (A Ctrl-C in a done-callback that ``close`` runs:
``test_dropped_session_order``.)"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

import pytest
from late_write_support import BLOCK, late_write_tier
from release_support import RESULT_TIMEOUT_S
from remote_support import BLOCK_LEN, fake_session, wait_for
from test_close_ctrl_c_lines import assert_closed, in_flight_tier

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess


def interrupt_waits_on_this_thread(tier: TierManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wait of this thread on the tier's condition gets a ``KeyboardInterrupt``, as a
    Ctrl-C would (other threads wait as usual)."""
    closing, wait = threading.get_ident(), tier._cond.wait

    def interrupted(timeout: float | None = None) -> bool:
        if threading.get_ident() == closing:
            raise KeyboardInterrupt
        return wait(timeout)

    monkeypatch.setattr(tier._cond, "wait", interrupted)


def test_a_ctrl_c_as_close_waits_for_transfers_still_closes_the_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``close`` marked the tier closed, then waited (up to its ``timeout``)
    for the transfers in flight; a Ctrl-C there, where a user's Ctrl-C lands as ``close``
    blocks, skipped the rest: the store in flight never resolved, the load in flight never
    settled, the poller ran on, the transport stayed open (with a host's session), and a
    second ``close`` returned at once, closing nothing."""
    with in_flight_tier(monkeypatch) as (tier, _, closed, futures):
        interrupt_waits_on_this_thread(tier, monkeypatch)  # as close waits for the transfers
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=60.0)
        assert_closed(closed, futures, "close's wait for the transfers")
        tier._thread.join(timeout=RESULT_TIMEOUT_S)
        assert not tier._thread.is_alive(), "the poller outlived close"


@pytest.mark.parametrize("wait", ["poller", "redialer", "session_ends"])
def test_a_ctrl_c_in_closes_bounded_waits_still_ends_the_sessions_and_the_transport(
    wait: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: once its transfers were cancelled, ``close`` joins the poller, stops
    the redialer and the thread ending dropped sessions, each a bounded wait; a Ctrl-C in any
    of them skipped the rest: the host's session was never ended (the host held its slots
    until its own timeout) and the transport (the NIXL agent) was never closed. The interrupt
    must still reach the caller, once close did all that."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="interrupted") as tier,
    ):
        tier.connect(server.address)
        closed = threading.Event()
        close_transport = tier.transport.close
        monkeypatch.setattr(tier.transport, "close", lambda: (closed.set(), close_transport()))
        owner = {"poller": tier._thread, "redialer": tier._redialer}
        owner["session_ends"] = tier._session_ends
        method = "join" if wait == "poller" else "stop"
        real = getattr(owner[wait], method)

        def interrupted(timeout: float) -> object:
            result = real(timeout)
            if not interrupts:
                return result
            raise interrupts.pop()  # Ctrl-C as close waits there

        interrupts = [KeyboardInterrupt()]

        monkeypatch.setattr(owner[wait], method, interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=RESULT_TIMEOUT_S)
        assert closed.is_set(), "the transport outlived close"
        assert_session_ended(server.address)


def test_a_ctrl_c_as_close_waits_for_release_threads_still_ends_the_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: before its last words, ``close`` waits for the release threads that
    carry ended sessions to hand back what they carry; a Ctrl-C there skipped every last word,
    so the host's session was never ended (its slots held until its own timeout)."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="interrupted") as tier,
    ):
        tier.connect(server.address)
        with tier._lock:
            tier._ended.carry("203.0.113.1:1", 1)  # a release thread still carrying elsewhere
        interrupt_waits_on_this_thread(tier, monkeypatch)  # as close waits for release threads
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=RESULT_TIMEOUT_S)
        assert_session_ended(server.address)


def test_a_ctrl_c_as_the_transport_closes_still_settles_the_cancelled_loads_once_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``close`` closes the transport, then asks it to settle the loads it
    cancelled once released (``on_released``); a Ctrl-C in the transport's close (its wait for
    a registration still running, which leaves the release to that registration) skipped the
    ask, so those loads never resolved, even once the agent was released."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        assert tier.store(["b"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
        reads = itertools.count(10_000)
        monkeypatch.setattr(transport, "read_blocks", lambda *_: next(reads))  # never lands
        loaded = tier.load(["b"], [2])

        interrupts = [KeyboardInterrupt()]

        def interrupted() -> None:  # (closed by then: a second close returns at once)
            if interrupts:
                raise interrupts.pop()  # Ctrl-C as the transport waits for a registration

        released: list[Callable[[], None]] = []
        monkeypatch.setattr(transport, "close", interrupted)
        monkeypatch.setattr(transport, "on_released", released.append)
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=0)
        assert not loaded.done(), "a cancelled load settled before the transport was released"
        assert released, "nothing settles the cancelled load once released"
        for settle in released:  # the registration returned: the transport released everything
            settle()
        assert loaded.result(timeout=RESULT_TIMEOUT_S).failed == {"b": "closed"}


def test_a_ctrl_c_as_close_waits_for_release_threads_still_says_what_it_could_not_tell(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: what ``close``'s last words could not tell the hosts (each keeps the
    named sessions' slots) is said in one warning once they were awaited; a Ctrl-C as it waited
    for the release threads raised before that warning, so a host left holding slots went
    unsaid."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        with tier._lock:
            tier._ended.give_back("203.0.113.1:1", ["ab" * 16])  # resolved, no longer dialled
            tier._ended.carry("203.0.113.2:1", 1)  # a release thread still carrying elsewhere
        interrupt_waits_on_this_thread(tier, monkeypatch)  # as close waits for release threads
        with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
            tier.close(timeout=RESULT_TIMEOUT_S)
        assert "could not tell 1 host(s) (203.0.113.1:1)" in caplog.text


def test_a_ctrl_c_between_closes_later_waits_still_closes_the_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: between its bounded waits, ``close`` uncounts the dropped sessions it
    ends itself under the tier's lock (whose acquire a Ctrl-C can cut short); a Ctrl-C there
    was outside the step that closes the transport, so the NIXL agent stayed alive and a
    second ``close`` returned at once."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        closed = threading.Event()
        monkeypatch.setattr(transport, "close", closed.set)
        uncount = tier._uncount_ends

        def interrupted(ending: list[tuple[object, bool]]) -> None:
            uncount(ending)
            raise KeyboardInterrupt  # Ctrl-C as close takes the lock there

        monkeypatch.setattr(tier, "_uncount_ends", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=0)
        assert closed.is_set(), "the transport outlived close"


def assert_session_ended(address: str) -> None:
    """The host at ``address`` lists no session but an observer's own: the tier's ended."""
    with fake_session(address, private=False) as observer:
        assert wait_for(lambda: len(observer.stats()["sessions"]) == 1, RESULT_TIMEOUT_S), (
            "the tier's session outlived close: "
            f"{observer.stats()['sessions']} (the observer's own is the only one)"
        )
