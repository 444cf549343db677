"""The tier's own threads (``TierThread``) and the futures it hands out (``TierFuture``): a
wait on such a future that is not done yet raises on such a thread instead of hanging.

The tier resolves its futures (``store``, ``load``, and ``PagedKVOffloader.offload``'s over
them), and so runs their done-callbacks, on the calling thread or on its own threads: the
poller (``tkvt-poller``), a host session's I/O thread (``tkvt-session-*``), and the threads
that connect, redial or follow membership. A callback there that waits for
another future of the tier (``result()``, ``exception()``) held that thread meanwhile: on the
poller nothing polled the transfer it waited for (the wait lasted its whole timeout, or for
ever), on a session's I/O thread that session's heartbeats and grant answers waited too (a
shared store waiting for a grant from that very thread never completed). Such a wait now
raises ``RuntimeError`` at once, whatever its timeout; a future already done returns at once
on any thread (a callback reads its own future so). A future not done as the wait starts
raises even if another thread resolves it a moment later: on these threads, read only the
futures known to be done. ``concurrent.futures.wait`` and ``as_completed`` do not call
``result()``: they still wait there (the hang as before), and must not be used on these
threads either. Every thread a tier starts in its process that runs its work or its futures'
callbacks is a ``TierThread`` (a host name's lookup, ``tkvt-resolve-*``, runs neither and is a
plain thread); a thread of one tier refuses the waits for another tier's futures too (it holds
up its own tier's work). The tier's integrations refuse their own waits there the same way
(``refused``): ``PagedKVOffloader``'s ``flush`` and ``close`` with offloads pending, a
``restore`` whose reads are under way, an ``offload`` or ``restore`` that would wait for free
arena slots raise ``RuntimeError`` at once on these threads (such a wait lasted its whole
timeout: only the poller's callbacks end it); those that need not wait run as anywhere.

Thread-safe: the mark is a thread-local flag, set as a ``TierThread`` starts and never
cleared; ``TierFuture`` adds no state, so creating and resolving one costs what a ``Future``
does, and a wait one thread-local look more (on a tier's thread, a ``done()`` look too).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class _Own(threading.local):
    tier = False  # True on a ``TierThread`` (a class default: no failed lookup elsewhere)


_own = _Own()


class TierThread(threading.Thread):
    """A thread the tier runs its own work (and its futures' callbacks) on: a
    ``threading.Thread`` marked so that a ``TierFuture`` not yet done refuses a wait on it."""

    def run(self) -> None:
        _own.tier = True
        super().run()


def on_tier_thread() -> bool:
    """Whether the calling thread is one of a tier's (``TierThread``), of any tier."""
    return _own.tier


class TierFuture(Future[T]):
    """A ``Future`` whose ``result()``/``exception()`` raise ``RuntimeError`` at once when it
    is not done yet and the caller runs on a tier's thread (module docstring); elsewhere, and
    once it is done, it is a plain ``Future``."""

    def result(self, timeout: float | None = None) -> T:
        if _own.tier and not self.done():  # (``on_tier_thread``, inlined)
            raise refused("result() of a tier future that is not done yet")
        return Future.result(self, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if _own.tier and not self.done():
            raise refused("exception() of a tier future that is not done yet")
        return Future.exception(self, timeout)


def refused(wait: str) -> RuntimeError:
    """The ``RuntimeError`` for ``wait`` (what would wait, e.g. "result() of a tier future that
    is not done yet") on the calling thread, a tier's: what to do instead."""
    thread = threading.current_thread().name
    return RuntimeError(
        f"{wait}, on the tier's own thread {thread!r} "
        "(in a done-callback, say): that thread would be held, and the transfer waited for "
        "may need it to finish. Chain a done-callback to the future instead "
        "(future.add_done_callback), or wait for it on a thread of your own."
    )
