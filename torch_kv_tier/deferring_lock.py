"""``DeferringLock``: a mutex that a thread can hand work to without waiting for it.

``run_soon(fn)`` runs ``fn`` under the lock: at once when the lock is free, else by the thread
that holds it, just before that thread releases it. A producer that must not stall behind the
lock's holder (a session's I/O thread applying a host's index events while a caller's store
holds the tier's lock through its transfer) therefore never blocks on it, and the work is still
done under the lock, in the order it was handed over, before anyone can read the state it
changes: every release runs what is queued first.

``run_now(fn)`` queues ``fn`` behind what is queued and waits until it ran.

Threading: any thread may call any method. Works as the lock of a ``threading.Condition``.
A deferred function that raises is logged and dropped; the exception never reaches the thread
that happened to release the lock (but a ``KeyboardInterrupt``, raised once the lock is
released). Not reentrant, like ``threading.Lock``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger(__name__)


class DeferringLock:
    """A ``threading.Lock`` that takes deferred work (module docstring)."""

    __slots__ = ("_deferred", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deferred: deque[Callable[[], None]] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        """Run what is queued, then release; what was queued meanwhile by a thread that found
        the lock held is run by taking the lock again, unless another thread holds it now (and
        runs it before it releases). Released also when a piece of work raises past its
        logging (a ``KeyboardInterrupt``: raised on, the rest left queued for the next holder),
        so that a Ctrl-C there never leaves the lock held for good."""
        while True:
            try:
                self._run_deferred()
            finally:
                self._lock.release()
            if not self._deferred or not self._lock.acquire(blocking=False):
                return

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def run_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` under the lock, now if it is free, else before its holder releases it.
        Never blocks."""
        self._deferred.append(fn)
        if self._lock.acquire(blocking=False):
            self.release()

    def run_now(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` under the lock after what is queued; returns once it ran. Blocks like
        ``acquire``."""
        self._deferred.append(fn)
        self._lock.acquire()
        self.release()

    def _run_deferred(self) -> None:
        deferred = self._deferred
        while deferred:
            fn = deferred.popleft()
            try:
                fn()
            except Exception:
                logger.exception("work deferred to the lock's holder failed")


__all__ = ["DeferringLock"]
