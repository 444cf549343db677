"""How other threads hand a ``RemoteSession``'s I/O thread (``session_io``) work: requests
(``_call_async``, ``_post``; ``with_commits``: behind the next commits), actions run on it
(``_enqueue_action``) and the commits it batches (``_add_commit``; a shared session's touches
too, ``add_to_batch``). Each is put under the session's lock (``_enqueue``), then one wake-up,
skipped when one is pending already. When batched commits go out is ``session_io``'s docstring.

Threading: every method may be called from any thread, the I/O thread included (an answer
callback). The session's lock guards what is handed over; the I/O thread is its only consumer
and takes each batch whole. A wake-up is one byte written to the session's socket pair without
blocking: a full buffer means one is pending already.

Failures: handing work over raises ``ConnectionError``, before anything is queued, once the
session is closed (its ``Disconnect`` may still go out: ``allow_closed``) or lost (saying why).
A request's future resolves with ``TimeoutError`` after its timeout, counted from its send; one
still unanswered (sent or not) when the I/O thread ends fails there with ``ConnectionError``
(``SessionIO._finish``): no future waits for ever.

``SessionHandoff`` is a part of ``RemoteSession`` (a base class, under ``SessionIO``): the state
it uses is set by ``RemoteSession.__init__``.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.replies import OnLate, Request


class SessionHandoff:
    """The other threads' half of ``RemoteSession``'s I/O (module docstring)."""

    peer_id: str
    _lock: threading.Lock
    _closed: bool
    _io_done: bool
    _lost_reason: str | None
    _timeout_s: float
    _requests: queue.SimpleQueue[Request]
    _actions: queue.SimpleQueue[Callable[[], None]]
    _commits: list[tuple[list[Any], list[int], list[int]]]
    _commits_watched: bool
    _riders: list[Request]
    _flush: bool
    _wake_w: socket.socket

    def _call_async(
        self,
        make: Callable[[int], p.ClientMessage],
        on_answer: Callable[[Future[p.ServerMessage]], None] | None = None,
        timeout_s: float | None = None,
        *,
        allow_closed: bool = False,
        with_commits: bool = False,
        late: OnLate | None = None,
    ) -> Future[p.ServerMessage]:
        """Send a request; its future resolves on the I/O thread (``TimeoutError`` after
        ``timeout_s``, default the session's, counted from its send), where ``on_answer`` then
        runs. ``with_commits``: it may wait for the next batch of commits and go out with it,
        without a wake-up of its own, while commits flow (at most ``session_io.COMMIT_PERIOD_S``).
        ``late`` gets an answer that comes after the timeout (the server did what was asked
        all the same: a grant's slots are this session's until it commits them), unless the
        server answered a later request first (it answers in order: this one never will be).
        Raises ``ConnectionError`` once closed or lost."""
        future: Future[p.ServerMessage] = Future()
        future.set_running_or_notify_cancel()
        if on_answer is not None:  # before the request exists: it cannot have an answer yet
            future.add_done_callback(on_answer)
        timeout = self._timeout_s if timeout_s is None else timeout_s
        request = (make, future, timeout, late)
        if with_commits:
            self._enqueue(lambda: self._ride(request), allow_closed)
        else:
            self._enqueue(lambda: self._requests.put(request), allow_closed)
        return future

    def send_batched(self) -> None:
        """Send the requests waiting for the next commits now, with the commits made so far
        (nothing when none waits: no wake-up)."""
        with self._lock:
            if not self._riders or self._io_done:
                return
            self._flush = True
        self._wake()

    def unsent_commits(self) -> list[tuple[list[Any], list[int], list[int]]]:
        """The batches of commits made but not sent yet (thread-safe: a snapshot being applied
        cannot have them, ``replica``)."""
        with self._lock:
            return list(self._commits)

    def _add_commit(self, commit: tuple[list[Any], list[int], list[int]]) -> bool:
        """(Lock held.) Batch ``commit``; whether the I/O thread needs a wake-up for it: only
        the first commit after a quiet period, which then goes out at once."""
        wake = add_to_batch(self._commits, [commit]) and not self._commits_watched
        self._flush |= wake
        return wake

    def _ride(self, request: Request) -> bool:
        """(Lock held.) Queue ``request`` for the next commits; whether the I/O thread needs a
        wake-up for it (it does not while it looks at the commits by their deadline)."""
        self._riders.append(request)
        wake = not self._commits_watched
        self._flush |= wake  # no deadline is watched: it goes out at that wake-up
        return wake

    def _post(self, make: Callable[[int], p.ClientMessage]) -> None:
        """Send a message that gets no answer."""
        self._enqueue(lambda: self._requests.put((make, None, 0.0, None)), False)

    def _enqueue_action(self, action: Callable[[], None]) -> None:
        self._enqueue(lambda: self._actions.put(action), False)

    def _enqueue(self, put: Callable[[], bool | None], allow_closed: bool) -> None:
        """Hand work to the I/O thread (``put`` runs under the lock) and wake it, unless
        ``put`` says a wake-up is pending already (it returns ``False``: a batch that was not
        empty, which the I/O thread has not taken yet)."""
        with self._lock:
            if self._lost_reason is not None:
                raise ConnectionError(f"session {self.peer_id} lost: {self._lost_reason}")
            if (self._closed and not allow_closed) or self._io_done:
                raise ConnectionError(f"session {self.peer_id} is closed")
            wake = put() is not False
        if wake:
            self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._io_done:
                return
            with contextlib.suppress(BlockingIOError):  # a wake-up is already pending
                self._wake_w.send(b"\0")


def add_to_batch(batch: list[Any], items: list[Any]) -> bool:
    """Append ``items`` to a batch the I/O thread takes whole; whether it was empty (only
    then does the I/O thread need a wake-up: one is pending for a batch not yet taken)."""
    was_empty = not batch
    batch.extend(items)
    return was_empty
