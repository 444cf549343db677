"""``TierManager.close`` with a Ctrl-C (``KeyboardInterrupt``) inside its cancel of the
transfers in flight, and injected at every line of close's path (``sys.settrace``), once and
twice: close still ends every session, closes the transport and resolves every future (a load
once nothing can land in its blocks), then raises the interrupt."""

from __future__ import annotations

import itertools
import linecache
import sys
import threading
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import pytest
from late_write_support import BLOCK, LateWriteTransport, late_write_tier
from release_support import RESULT_TIMEOUT_S
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier import closing, transfers
from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.session_ends import SessionEnds
from torch_kv_tier.session_releases import SessionReleases

# close's own path: every function of closing.py, the stop of the thread ending sessions, and
# the setting out of the last words to the hosts
CLOSE_PATH = {
    *(
        fn.__code__
        for cls in vars(closing).values()
        if isinstance(cls, type) and cls.__module__ == closing.__name__
        for fn in vars(cls).values()
        if isinstance(fn, types.FunctionType)
    ),
    SessionEnds.stop.__code__,
    SessionReleases._end_sessions.__code__,
}


def _ctrl_c_at_lines(*at: int) -> list[str]:
    """Arm a ``KeyboardInterrupt`` at each ``at``-th line run of ``CLOSE_PATH`` on this thread
    (``sys.settrace``; not at a ``with``, ``try``, ``except`` or ``finally`` line, where no
    signal lands); returns the lines hit, as they are hit. A trace function that raises is
    unset by Python: a profile function sets it again at the next call or return, on the
    frames of ``CLOSE_PATH`` still running, so that a second one is injected too. Disarm with
    ``sys.setprofile(None)``, then ``sys.settrace(None)``."""
    seen: list[str] = []

    def local(frame: types.FrameType, event: str, arg: object) -> Callable[..., object]:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and not line.startswith(("with ", "try:", "except", "finally:")):
            seen.append(line)
            if len(seen) in at:
                raise KeyboardInterrupt
        return local

    def trace(frame: types.FrameType, event: str, arg: object) -> object:
        return local if frame.f_code in CLOSE_PATH else None

    def rearm(frame: types.FrameType | None, event: str, arg: object) -> None:
        if len(seen) >= max(at) or sys.gettrace() is not None:
            return
        sys.settrace(trace)  # type: ignore[arg-type]
        while frame is not None:
            if frame.f_code in CLOSE_PATH:
                frame.f_trace = local
            frame = frame.f_back

    sys.settrace(trace)  # type: ignore[arg-type]
    sys.setprofile(rearm)
    return seen


class StubSession:
    """A host's session as close ends it: counts its ends."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id, self.session_id, self.address = peer_id, f"s-{peer_id}", "192.0.2.1:1"
        self.ended: list[bool] = []
        self.released: list[str] = []
        self.ended_clean = False

    def close(self, clean: bool) -> None:
        self.ended.append(clean)

    def release(self, held: list[str]) -> None:
        self.released += held

    def unreleased(self) -> list[str]:
        return []

    def report_usage(self, *_: Any) -> None:
        pass


@contextmanager
def in_flight_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[TierManager, LateWriteTransport, threading.Event, list[Future[Any]]]]:
    """A tier with a store and a load in flight (neither lands), its transport's close
    noted (the event) and not run; yields the tier, transport, event, and [store, load]."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        assert tier.store(["b"], [1]).result(timeout=RESULT_TIMEOUT_S).ok
        transport.hold = True  # the next store's write stays in flight
        reads = itertools.count(10_000)
        monkeypatch.setattr(transport, "read_blocks", lambda *_: next(reads))  # never lands
        closed = threading.Event()
        monkeypatch.setattr(transport, "close", closed.set)
        yield tier, transport, closed, [tier.store(["a"], [0]), tier.load(["b"], [2])]


def assert_closed(closed: threading.Event, futures: list[Future[Any]], hit: object) -> None:
    """The transport closed, the store and the load failed "closed" (``in_flight_tier``)."""
    assert closed.is_set(), f"Ctrl-C at {hit}: the transport outlived close"
    stored, loaded = (f.result(timeout=RESULT_TIMEOUT_S) for f in futures)
    assert stored.failed == {"a": "closed"} and loaded.failed == {"b": "closed"}, hit


def test_a_ctrl_c_in_the_cancel_still_closes_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a Ctrl-C inside ``close``'s cancel of the transfers in flight (in
    ``transport.cancel``, which takes the transport's lock) skipped every later step: the
    store in flight never resolved, the load never settled, the transport (the NIXL agent)
    stayed open, and a second ``close`` returned at once."""
    with in_flight_tier(monkeypatch) as (tier, transport, closed, futures):
        cancel, interrupts = transport.cancel, [KeyboardInterrupt()]

        def interrupted(ids: list[int], *args: Any) -> list[int]:
            if interrupts:
                raise interrupts.pop()  # Ctrl-C as the cancel waits for the transport's lock
            return cancel(ids, *args)

        monkeypatch.setattr(transport, "cancel", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=0)
        assert_closed(closed, futures, "transport.cancel")
        tier._thread.join(timeout=RESULT_TIMEOUT_S)
        assert not tier._thread.is_alive(), "the poller outlived close"


def _close_interrupted(tier: TierManager, *at: int) -> list[str]:
    """``tier.close(timeout=0)`` with a Ctrl-C at each ``at``-th line of close's path; the
    lines hit. Asserts the interrupt reached the caller if one was injected, and that only one
    before close began its work (it checks its argument, tells handshakes to give up) leaves
    the tier open, to be closed again (then closed here)."""
    seen = _ctrl_c_at_lines(*at)
    try:
        tier.close(timeout=0)
    except KeyboardInterrupt:
        assert seen and len(seen) >= min(at), "an interrupt came from nowhere"
    else:
        assert len(seen) < min(at), f"Ctrl-C at {seen[min(at) - 1]!r} never reached the caller"
    finally:
        sys.setprofile(None)  # first: its own call would arm the trace again
        sys.settrace(None)
    if not tier.closed:  # only if interrupted before close's work began
        assert "self._close_steps(duty)" not in seen[: min(at)], f"Ctrl-C at {seen[-1]!r}"
        tier.close(timeout=0)
    return seen


def test_a_ctrl_c_at_any_line_of_close_or_two_still_closes_the_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review (a ``KeyboardInterrupt`` injected at every line of close's path, then
    a second at each line after it): a Ctrl-C as ``close`` took the tier's state, cancelled
    the transfers in flight, or between its steps after that (as the sessions not started
    were taken, as a wait returned, as the cancelled loads settled) left a session never
    ended, the transport open or a future never resolved. Each must hold whatever lines the
    interrupts land on."""
    runs = 0  # (about 2,000, in about 10 s)
    for first in itertools.count(1):
        for second in [None, *range(first + 1, first + 30)]:
            at = (first,) if second is None else (first, second)
            with in_flight_tier(monkeypatch) as (tier, _, closed, futures):
                session, dropped = StubSession("p"), StubSession("q")
                tier._peers["p"].session = session
                tier._session_ends.stop(RESULT_TIMEOUT_S)  # a dropped session never started:
                tier._session_ends = SessionEnds(tier._end_dropped, tier._rearm_redialer)
                with tier._lock:
                    tier._end_later(dropped, True)  # close ends it
                    tier._ended.give_back(session.address, ["s-resolved"])  # close names it
                seen = _close_interrupted(tier, *at)
                hit = [seen[i - 1] for i in at if i <= len(seen)]
                runs += 1
                wait_for(lambda s=session, d=dropped: s.ended and d.ended, RESULT_TIMEOUT_S)
                assert session.ended == [False], f"Ctrl-C at {hit}: ended {session.ended}"
                assert dropped.ended == [True], f"Ctrl-C at {hit}: ended {dropped.ended}"
                named = session.released + dropped.released
                assert named == ["s-resolved"], f"Ctrl-C at {hit}: named {named}"
                assert_closed(closed, futures, hit)
            if len(seen) < max(at):  # it ran through: no line left for this interrupt
                break
        if len(seen) < first:
            break
    assert runs > 1000


def test_a_ctrl_c_at_any_line_of_close_still_ends_the_session_at_its_host() -> None:
    """A ``torch-kv-tier serve`` host: whatever line of close's path a Ctrl-C lands on, the
    tier's session ends at the host (its slots freed) and the transport (the NIXL agent)
    closes."""
    with ServerProcess.start(64, BLOCK_LEN) as server:
        for k in itertools.count(1):
            tier = TierManager.create(16, BLOCK_LEN, name="interrupted")
            tier.connect(server.address)
            seen = _close_interrupted(tier, k)
            with pytest.raises(RuntimeError):  # closed: every method raises
                tier.transport.cancel([])
            with fake_session(server.address, private=False) as observer:
                assert wait_for(lambda: len(observer.stats()["sessions"]) == 1, RESULT_TIMEOUT_S), (
                    f"Ctrl-C at {seen[-1]!r}: the tier's session outlived close"
                )
            if len(seen) < k:
                break
    assert k > 20


def test_a_ctrl_c_as_close_resolves_the_futures_still_resolves_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a Ctrl-C as ``_flush`` entered ``resolve``, once it had taken the
    settled requests out of the tier, lost them: ``close`` ran again and resolved nothing,
    so the store cancelled in flight never resolved (its caller waited forever)."""
    with in_flight_tier(monkeypatch) as (tier, _, closed, futures):
        interrupts = [KeyboardInterrupt()]

        def interrupted(ready: list[Any]) -> None:
            if interrupts:
                raise interrupts.pop()  # Ctrl-C as resolve is entered
            closing_resolve(ready)

        closing_resolve = transfers.resolve
        monkeypatch.setattr(transfers, "resolve", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=0)
        assert not interrupts, "the interrupt was never injected"
        assert_closed(closed, futures, "resolve")
