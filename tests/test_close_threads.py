"""``TierManager.close`` on several threads at once: each returns only once the tier is closed
(or raises the first one's failure, or ``TimeoutError`` past its own timeout); one in a
done-callback, on the closing thread or on the poller, returns at once instead of waiting for
the close under way (which may be waiting for it)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from late_write_support import BLOCK, LateWriteTransport, late_write_tier
from release_support import RESULT_TIMEOUT_S
from remote_support import wait_for

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager


class HeldClose:
    """A transport's ``close`` that waits for ``release`` (then raises ``error``, if any)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.entered, self.release, self.closed = (threading.Event() for _ in range(3))
        self.error = error

    def __call__(self) -> None:
        self.entered.set()
        assert self.release.wait(RESULT_TIMEOUT_S), "the test never released the close"
        if self.error is not None:
            raise self.error
        self.closed.set()


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` on a thread of its own, started; what it returned or raised lands in the list."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@contextmanager
def closing_on_a_thread(
    monkeypatch: pytest.MonkeyPatch, held: HeldClose
) -> Iterator[tuple[TierManager, LateWriteTransport, list[Any]]]:
    """A tier whose close runs on a thread of its own, held in its transport's close (by
    ``held``) as the test runs; then released, and that close's outcome checked to be in."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        monkeypatch.setattr(transport, "close", held)
        first, outcome = in_thread(tier.close)
        assert held.entered.wait(RESULT_TIMEOUT_S)
        try:
            yield tier, transport, outcome
        finally:
            held.release.set()
            first.join(RESULT_TIMEOUT_S)
            assert outcome, "the first close never returned"


def test_a_second_close_returns_only_once_the_first_closed_the_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a ``close`` while another thread's was under way returned at once,
    the transport still open and the sessions not ended (a signal handler's thread and the
    main thread closing together)."""
    held = HeldClose()
    with closing_on_a_thread(monkeypatch, held) as (tier, _, _first):
        second, outcome = in_thread(lambda: (tier.close(), held.closed.is_set())[1])
        second.join(0.2)  # (a window for the bug: it returned at once)
        assert not outcome, f"close returned as another thread's was under way: {outcome}"
        held.release.set()
        second.join(RESULT_TIMEOUT_S)
        assert outcome == [True], "close returned before the transport was closed"


def test_a_second_close_that_outwaits_its_timeout_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``close`` that the other thread's outlasts by more than its own ``timeout`` (plus
    1 s) raises ``TimeoutError`` naming that thread, rather than return with the tier open."""
    with closing_on_a_thread(monkeypatch, HeldClose()) as (tier, _, _first):
        pytest.raises(TimeoutError, tier.close, timeout=0).match("has not finished")


def test_a_second_close_raises_what_failed_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first ``close`` failed (its transport's close raised): the one that waited for it
    says so, rather than return as if the tier were closed; so does a later one on another
    thread (here, the test's last, as it leaves the tier)."""
    held = HeldClose(RuntimeError("the agent would not go"))
    with (
        pytest.raises(RuntimeError, match="failed .*the agent would not go"),
        closing_on_a_thread(monkeypatch, held) as (tier, _, first),
    ):
        second, outcome = in_thread(tier.close)
        held.release.set()
        second.join(RESULT_TIMEOUT_S)
        assert wait_for(lambda: bool(first), RESULT_TIMEOUT_S)
        assert isinstance(first[0], RuntimeError)
        (error,) = outcome
        assert isinstance(error, RuntimeError) and "the agent would not go" in str(error)


def test_a_close_in_a_callback_on_the_closing_thread_returns_at_once() -> None:
    """``close`` resolves a store it cancelled on its own thread: a done-callback that calls
    ``close`` there returns at once (waiting for the close it runs in would never end)."""
    seen: list[BaseException | None] = []
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        transport.hold = True  # stays in flight: close cancels it
        store = tier.store(["a"], [0])

        def close_again(_: object) -> None:
            try:
                tier.close(timeout=0)
                seen.append(None)
            except BaseException as exc:
                seen.append(exc)

        store.add_done_callback(close_again)
        tier.close(timeout=0)
        assert seen == [None] and store.result(timeout=0).failed == {"a": "closed"}


def test_a_close_in_a_callback_on_the_poller_returns_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A done-callback on the poller calls ``close`` while another thread's close waits for
    the transfers in flight, then joins the poller: it returns at once (the close under way
    finishes the tier), rather than wait for a close that waits for it."""
    returned: list[bool] = []  # whether the transport was closed as the callback's close returned
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        transport.hold = True
        closed = threading.Event()
        monkeypatch.setattr(transport, "close", closed.set)
        store = tier.store(["a"], [0])
        store.add_done_callback(lambda _: returned.append(tier.close() or closed.is_set()))
        first, outcome = in_thread(lambda: tier.close(timeout=RESULT_TIMEOUT_S))
        assert wait_for(lambda: tier.closed, RESULT_TIMEOUT_S)  # it waits for the write
        (tid,) = transport.in_flight()
        transport.land(tid)  # the poller completes it, and runs the callback
        first.join(RESULT_TIMEOUT_S)
        assert outcome == [None] and store.result(timeout=0).ok
        assert returned == [False], "the callback's close waited for the close under way"


def test_a_signal_handler_s_close_then_sys_exit_on_the_closing_thread_still_closes_the_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a handler that calls ``close()`` then ``sys.exit()`` (a SIGTERM
    handler's way out) landing on the thread already in ``close``: its ``close()`` returns at
    once, and its ``SystemExit`` abandoned the close under way: the transport was never closed,
    a retry there returned as if it were, and a close on another thread raised
    ``TimeoutError`` saying that close went on. It closes the tier, then ``SystemExit``."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, transport):
        closed = threading.Event()
        monkeypatch.setattr(transport, "close", closed.set)
        transport.hold = True  # stays in flight: close cancels it, and runs the callback
        store = tier.store(["a"], [0])

        def handler(_: object) -> None:  # as a signal handler on the closing thread
            tier.close()
            sys.exit(0)

        store.add_done_callback(handler)
        with pytest.raises(SystemExit):
            tier.close(timeout=0)
        assert closed.is_set(), "the SystemExit left the transport open"
        other, outcome = in_thread(lambda: tier.close(timeout=0))
        other.join(RESULT_TIMEOUT_S)
        assert outcome == [None], f"another thread's close: {outcome}"


def test_a_close_left_part_way_by_three_interrupts_says_so_to_the_closes_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a third Ctrl-C (as the second one's retry ran) left the close under way
    part-way, and never told the closes waiting for it: each waited out its timeout, then
    raised ``TimeoutError`` saying that close went on (none did). They raise ``RuntimeError``
    from the interrupt at once."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        interrupts = [KeyboardInterrupt() for _ in range(3)]

        def interrupted_flush() -> None:
            if interrupts:
                raise interrupts.pop()

        monkeypatch.setattr(tier, "_flush", interrupted_flush)  # close's, once a run
        with pytest.raises(KeyboardInterrupt):
            tier.close(timeout=0)
        assert not interrupts, "close was interrupted fewer than three times"
        other, outcome = in_thread(lambda: tier.close(timeout=RESULT_TIMEOUT_S))
        other.join(RESULT_TIMEOUT_S)
        assert outcome, "another thread's close still waits for the close left part-way"
        (error,) = outcome
        assert isinstance(error, RuntimeError), f"another thread's close: {error!r}"
        assert isinstance(error.__cause__, KeyboardInterrupt)
