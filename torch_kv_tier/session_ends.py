"""``SessionEnds``: the one thread of a tier that starts threads for it, so that nobody under
the tier's lock, nor the poller, waits on the OS for a thread to start.

A dropped peer's session must end (which waits for its host), then the host may be dialled
again. Whoever drops the peer (a caller whose store was refused, the poller, a session's I/O
thread) holds the tier's lock then, so it only hands the session over (``put``: a short lock of
this class's own, never held across a thread start); this thread starts an ``END_THREAD`` for it
at once, whatever the poller is doing (a long ``transport.poll``, a slow done-callback). It also
calls ``tick`` about once a second, unlocked: the tier re-arms its redialer there (a redialer
whose thread could not start, the process at its thread limit).

A thread that cannot start (``RuntimeError``, the thread limit) hands back the sessions not
started, tried again after ``_RETRY_S`` (logged as a warning). ``stop`` returns those never
started, for ``close`` to end; once ``stop`` has begun, this thread ends the ones whose thread
could not start itself (``stop`` may have returned already). So each session handed over is
ended exactly once: by its ``END_THREAD``, by this thread, or by the one that called ``stop``
(which takes no session out of the queue: what it returns, it returns again).

Threading: ``put`` and ``stop`` from any thread (``put`` under the tier's lock too); ``end`` and
``tick`` run on threads of their own, without this class's lock.

Ownership: ``end`` and ``tick`` are methods of the tier, held weakly: the tier owns this object,
so a strong hold would be a cycle no closed tier is freed from without the collector
(``tests/test_agent_lifetime.py``). Should the tier be gone while the thread still runs (its
``stop`` timed out), the thread returns.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from torch_kv_tier.tier_threads import TierThread

logger = logging.getLogger(__name__)

ENDS_THREAD = "tkvt-ends"  # starts the threads below, and ticks
END_THREAD = "tkvt-session-end"  # ends a dropped peer's session, which waits for its host
_RETRY_S = 1.0  # after a thread that could not start (the process at its thread limit)
_TICK_S = 1.0  # how often ``tick`` runs


class SessionEnds:
    """Starts the threads that end dropped peers' sessions (module docstring)."""

    def __init__(self, end: Callable[[Any, bool], None], tick: Callable[[], None]) -> None:
        self._end = weakref.WeakMethod(end)  # the tier's (module docstring: ownership)
        self._tick = weakref.WeakMethod(tick)
        self._cond = threading.Condition()
        self._queue: list[tuple[Any, bool]] = []  # (session, clean), not started yet
        self._stopped = False
        self._thread = TierThread(target=self._run, name=ENDS_THREAD, daemon=True)

    def start(self) -> None:
        """Start the thread (once; ``RuntimeError`` at the process's thread limit)."""
        self._thread.start()

    def put(self, session: Any, clean: bool) -> None:
        """End ``session`` (``end(session, clean)``) on a thread of its own, started at once.
        Never waits but for this class's lock (held only to queue and take)."""
        with self._cond:
            self._queue.append((session, clean))
            self._cond.notify()

    def __len__(self) -> int:
        """How many sessions handed over have no thread started yet."""
        with self._cond:
            return len(self._queue)

    def stop(self, timeout: float) -> list[tuple[Any, bool]]:
        """Stop; wait up to ``timeout`` s for the thread (which may be starting one). Returns
        the sessions no thread was started for, nor will be: the caller ends them. They stay
        queued, the same at every call: a caller that a Ctrl-C cut short asks again."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
        with self._cond:
            return list(self._queue)

    def _run(self) -> None:
        tick_at = time.monotonic() + _TICK_S
        retry_at = 0.0
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                due = bool(self._queue) and now >= retry_at
                if not due and now < tick_at:
                    wake = min(tick_at, retry_at) if self._queue else tick_at
                    self._cond.wait(timeout=max(wake - now, 0.001))
                    continue
                ending, self._queue = (self._queue, []) if due else ([], self._queue)
            if ending and not self._start_all(ending):
                retry_at = time.monotonic() + _RETRY_S
            if time.monotonic() >= tick_at:
                tick_at = time.monotonic() + _TICK_S
                tick = self._tick()
                if tick is None:  # the tier is gone
                    return
                try:
                    tick()
                except Exception:
                    logger.exception("the tier's periodic look (re-arming its redialer) failed")

    def _start_all(self, ending: list[tuple[Any, bool]]) -> bool:
        """An ``END_THREAD`` for each of ``ending``; ``False`` when one could not start (the
        rest handed back, or, once ``stop`` has begun, ended here)."""
        end = self._end()
        if end is None:  # the tier is gone (ownership): nothing to end its sessions with
            return True
        for i, (session, clean) in enumerate(ending):
            thread = TierThread(target=end, args=(session, clean), name=END_THREAD, daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:
                with self._cond:
                    stopped = self._stopped
                    if not stopped:
                        self._queue[:0] = ending[i:]
                if stopped:
                    for rest in ending[i:]:
                        end(*rest)
                    return True
                logger.warning(
                    "could not start a thread to end %d dropped sessions (tried again in "
                    "%.0f s; their hosts are dialled again once they ended): %s",
                    len(ending) - i,
                    _RETRY_S,
                    exc,
                )
                return False
        return True


__all__ = ["END_THREAD", "ENDS_THREAD", "SessionEnds"]
