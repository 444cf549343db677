"""Frozen and silent hosts, each on a tier whose transport and host sessions are in this process
(``tier_races_support``): close ends their sessions within one timeout, a session ended unused
keeps the releases it carried, a host due while others are greeted is tried at once, and stop
waits for a greeter that saw it first."""

from __future__ import annotations

import logging
import threading
import time
import types

import pytest
import torch
import zmq
from late_write_support import LateWriteTransport
from remote_support import BLOCK_LEN, free_port, wait_for
from tier_races_support import RESULT_TIMEOUT_S, PrivateSession, in_process_tier

from torch_kv_tier import connections, session_releases
from torch_kv_tier.arena import BlockArena
from torch_kv_tier.connections import Dial, Redialer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.greeting import Greeting

logger = logging.getLogger(__name__)


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


class _UnansweredSession(PrivateSession):
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
    with in_process_tier() as (tier, transport):
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
