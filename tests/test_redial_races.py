"""Races of a tier's redials, each on a tier whose transport and host sessions are in this process
(``tier_races_support``): a join or redial whose session is lost at once, a host removed or lost
again while it is redialled, and a redial thread that cannot start."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch
from remote_support import BLOCK_LEN, wait_for
from tier_races_support import RESULT_TIMEOUT_S, PrivateSession, SharedSession, in_process_tier

from torch_kv_tier import connections
from torch_kv_tier.connections import Dial, Redialer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.greeting import Greeting


def test_a_join_whose_session_is_lost_before_the_index_came_fails_at_once() -> None:
    """A shared host lost while the tier waits for its index: the join fails with
    ``ConnectionError`` at once (it waited out its whole timeout, then raised ``KeyError``),
    the host is dropped and its session ended clean (no store of it in flight)."""
    with in_process_tier() as (tier, transport):
        transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        session = SharedSession("h", 8)
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
    with in_process_tier() as (tier, transport):
        session = SharedSession("h", 8)
        session.lost = "reset"  # lost as soon as it joined
        transport.remotes[b""] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        monkeypatch.setattr(TierManager, "_open", lambda self, dial, release, private: session)
        dial = Dial("h:1", None, False, None, 1.0, 1.0)
        tier._dials["h"] = dial  # the host was connected before, then lost
        with pytest.raises(ConnectionError):
            tier._redial(dial)
        assert tier._wants_dial(dial) and tier.peers() == []


def test_a_host_removed_while_it_is_redialled_stays_removed_and_is_then_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The user removes a lost host while the redialer's handshake with it runs: the session
    that handshake opens ends at once, and then the tier forgets the host (how it was dialled
    stayed in ``_removed`` for good; forgetting it while the redial ran let the host back)."""
    with in_process_tier() as (tier, transport):
        session = PrivateSession()
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
    with in_process_tier() as (tier, transport):
        session = PrivateSession()
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
    with in_process_tier() as (tier, _):
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
