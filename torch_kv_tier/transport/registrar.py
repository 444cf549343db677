"""``Registrar``: the one daemon thread that runs a ``NixlTransport``'s peer registrations, in
the order they were submitted.

Exit. A registration that never returns (a remote metadata load stuck in NIXL) must not hold
the process at exit, closed or not: interpreter exit joined a ``ThreadPoolExecutor``'s thread
for good. A registration that is only slow (seconds for a big region) must still end before
the interpreter does: ended under it, NIXL aborted the process ("terminate called without an
active exception"). So the thread is a daemon, and an ``atexit`` hook starts no queued
registration any more and waits for the running ones at most ``EXIT_WAIT_S`` in all; past that
it logs them and the process exits without them. A transport that is closed still waits for
its registration (``CLOSE_REGISTRATION_WAIT_S``) and releases what it built.

Threading: ``submit`` and ``shutdown`` may be called from any thread. The thread starts at the
first ``submit``; it ends after ``shutdown`` (or once the registrar is collected), when every
registration submitted before has run. It holds no reference to a registration once it ran.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from torch_kv_tier.tier_threads import TierThread

# The transport's logger: these lines are the transport's.
logger = logging.getLogger("torch_kv_tier.transport.nixl")

T = TypeVar("T")

_Job = tuple["Future[Any]", Callable[[], Any]]
_Jobs = queue.SimpleQueue["_Job | None"]

EXIT_WAIT_S = 5.0
"""How long interpreter exit waits, in all, for the registrations still running."""

_threads_lock = threading.Lock()
_threads: dict[threading.Thread, _Jobs] = {}  # the live registrar threads and their queues
_exiting = False  # the exit hook ran: no queued registration starts
_hooked = False  # the exit hook is registered


class Registrar:
    """Runs callables one at a time, in order, on a daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: _Jobs = queue.SimpleQueue()
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
                _start(self._name, self._jobs)
        return future

    def shutdown(self) -> None:
        """Take no more; the thread ends once what was queued has run. Returns at once."""
        with self._lock:
            if not self._shut:
                self._shut = True
                self._jobs.put(None)


def _start(name: str, jobs: _Jobs) -> None:
    global _hooked
    thread = TierThread(target=_run, args=(jobs,), name=name, daemon=True)
    with _threads_lock:
        if not _hooked:  # after the exit hooks of what is imported (torch, NIXL): runs first
            atexit.register(_wait_at_exit)
            _hooked = True
        _threads[thread] = jobs
    thread.start()


def _run(jobs: _Jobs) -> None:
    """The thread: run each job until the ``None`` that ends it (none once exit began)."""
    try:
        while (job := jobs.get()) is not None:
            if _exiting:
                job[0].cancel()
            else:
                _run_one(*job)
            del job  # hold nothing of it while waiting for the next
    finally:
        with _threads_lock:
            _threads.pop(threading.current_thread(), None)


def _run_one(future: Future[Any], fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as exc:  # the future carries it, as an executor's does
        future.set_exception(exc)
    else:
        future.set_result(result)


def _wait_at_exit() -> None:
    """Interpreter exit: end every registrar thread, waiting at most ``EXIT_WAIT_S`` in all."""
    global _exiting
    with _threads_lock:
        _exiting = True
        threads = list(_threads.items())
    for _, jobs in threads:
        jobs.put(None)
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread, _ in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    stuck = [thread.name for thread, _ in threads if thread.is_alive()]
    if stuck:
        logger.warning(
            "exiting with peer registrations still running after %g s (NIXL's add_remote_agent "
            "or prep_xfer_dlist did not return) on %s",
            EXIT_WAIT_S,
            ", ".join(stuck),
        )
