"""``DeferringLock``: work handed over never waits for the holder, always runs under the lock,
in order, before the holder's release returns, and none is lost in a race with a release."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from torch_kv_tier.deferring_lock import DeferringLock


def test_work_runs_at_once_when_the_lock_is_free() -> None:
    lock = DeferringLock()
    ran: list[bool] = []
    lock.run_soon(lambda: ran.append(lock.locked()))
    assert ran == [True]  # under the lock
    assert not lock.locked()


def test_work_handed_over_while_held_runs_before_the_holders_release_returns() -> None:
    lock = DeferringLock()
    ran: list[int] = []
    lock.acquire()

    def produce() -> None:
        for i in range(3):
            lock.run_soon(lambda i=i: ran.append(i))  # type: ignore[misc]

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(timeout=5.0)
    assert not producer.is_alive(), "run_soon waited for the lock's holder"
    assert ran == []
    lock.release()
    assert ran == [0, 1, 2]
    assert not lock.locked()


def test_run_now_waits_for_the_holder_and_for_what_was_queued_before() -> None:
    lock = DeferringLock()
    ran: list[str] = []
    lock.acquire()
    lock.run_soon(lambda: ran.append("soon"))
    waiter = threading.Thread(target=lambda: lock.run_now(lambda: ran.append("now")))
    waiter.start()
    time.sleep(0.05)
    assert ran == [] and waiter.is_alive()
    lock.release()
    waiter.join(timeout=5.0)
    assert ran == ["soon", "now"]


def _fail() -> None:
    raise ZeroDivisionError("deferred work failing")


def test_a_failing_piece_of_work_is_logged_and_never_reaches_the_releasing_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lock = DeferringLock()
    ran: list[int] = []
    with lock:
        lock.run_soon(_fail)
        lock.run_soon(lambda: ran.append(1))
    assert ran == [1]
    assert "deferred" in caplog.text and "ZeroDivisionError" in caplog.text
    assert caplog.records[0].levelno == logging.ERROR


class _PausedRelease(DeferringLock):
    """Runs ``pause`` once, in a release, after the queued work ran and before the lock is let
    go: the moment a producer finds the lock held and leaves its work for the holder."""

    __slots__ = ("pause",)

    def __init__(self) -> None:
        super().__init__()
        self.pause: Callable[[], None] | None = None

    def _run_deferred(self) -> None:
        super()._run_deferred()
        pause, self.pause = self.pause, None
        if pause is not None:
            pause()


def test_work_handed_over_between_the_holders_last_check_and_its_release_still_runs() -> None:
    lock = _PausedRelease()
    ran: list[str] = []

    def producer_finds_the_lock_held() -> None:
        t = threading.Thread(target=lambda: lock.run_soon(lambda: ran.append("late")))
        t.start()
        t.join(timeout=5.0)
        assert not t.is_alive()
        assert ran == []  # left for the holder, which already ran its queue once

    lock.pause = producer_finds_the_lock_held
    with lock:
        pass
    assert ran == ["late"]  # with no further use of the lock
    assert not lock.locked() and not lock._deferred


def test_it_serves_as_the_lock_of_a_condition() -> None:
    lock = DeferringLock()
    cond = threading.Condition(lock)  # type: ignore[arg-type]
    ran: list[str] = []
    ready = threading.Event()

    def waiter() -> None:
        with cond:
            ready.set()
            cond.wait(timeout=5.0)  # releases the lock: deferred work runs
            ran.append("woken")

    t = threading.Thread(target=waiter)
    t.start()
    assert ready.wait(5.0)
    lock.run_soon(lambda: ran.append("deferred"))
    with cond:
        cond.notify()
    t.join(timeout=5.0)
    assert ran == ["deferred", "woken"]


def test_a_ctrl_c_in_deferred_work_still_releases_the_lock() -> None:
    """Found by review: a ``KeyboardInterrupt`` in work the holder ran as it released (a
    Ctrl-C landing there) left the lock held for good: every later user of the tier's lock
    (``close``'s retry after that Ctrl-C, the poller) waited forever. The interrupt reaches
    the holder, the lock is free, and the work queued behind runs at the next release."""
    lock = DeferringLock()
    ran: list[str] = []

    def ctrl_c() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), lock:
        lock.run_soon(ctrl_c)
        lock.run_soon(lambda: ran.append("after"))
    assert not lock.locked()
    assert lock.acquire(timeout=1.0)
    lock.release()
    assert ran == ["after"]
