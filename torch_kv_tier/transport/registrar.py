"""``Registrar``: the one daemon thread that runs a ``NixlTransport``'s peer registrations, in
the order they were submitted.

Why a daemon thread and not a ``ThreadPoolExecutor``: interpreter exit joins an executor's
threads, so a registration that never returns (a remote metadata load stuck in NIXL) held the
process at exit for good, whether or not the transport was closed. Exit does not wait for a
daemon thread: the process ends, and the NIXL agent the registration holds ends with it. A
transport that is closed still waits for its registration (``CLOSE_REGISTRATION_WAIT_S``) and
releases what it built, so nothing is left registered in the normal path.

Threading: ``submit`` and ``shutdown`` may be called from any thread. The thread starts at the
first ``submit``; it ends after ``shutdown`` (or once the registrar is collected), when every
registration submitted before has run. It holds no reference to a registration once it ran.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple["Future[Any]", Callable[[], Any]]


class Registrar:
    """Runs callables one at a time, in order, on a daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._shut = False
        weakref.finalize(self, self._jobs.put, None)  # collected unshut: the thread ends

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn``; its future resolves with what it returns or raises.

        Raises ``RuntimeError`` after ``shutdown``.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: no registration can start after shutdown")
            self._jobs.put((future, fn))
            if not self._started:
                self._started = True
                threading.Thread(
                    target=_run, args=(self._jobs,), name=self._name, daemon=True
                ).start()
        return future

    def shutdown(self) -> None:
        """Take no more; the thread ends once what was queued has run. Returns at once."""
        with self._lock:
            if not self._shut:
                self._shut = True
                self._jobs.put(None)


def _run(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """The thread: run each job until the ``None`` that ends it."""
    while (job := jobs.get()) is not None:
        _run_one(*job)
        del job  # hold nothing of it while waiting for the next


def _run_one(future: Future[Any], fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as exc:  # the future carries it, as an executor's does
        future.set_exception(exc)
    else:
        future.set_result(result)
