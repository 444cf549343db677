"""The I/O thread of a ``RemoteSession``: the only user of its ZeroMQ socket once the handshake
is done. Other threads hand it work through ``session_handoff`` (put under the session's lock,
then one wake-up, skipped when one is pending already).

Each wake-up (a request queued from any thread, a frame from the server, a heartbeat, request or
batch deadline) it runs queued actions, sends the commits and touches batched since the last
send (as few frames as fit, always before the requests made after them), sends queued requests,
hands answers to their futures (``replies``: an answer after its request's timeout is dropped,
but a grant's, whose slots the server counts granted all the same) and pushed ``Events`` to the
follower, and heartbeats (not once closed: the host ends the session at its ``Disconnect`` and
would answer a later heartbeat that it no longer knows the session). It ends the session,
loudly (``on_lost``), when the server stops answering heartbeats, says it no longer knows the
session, the control connection closes or is reset (the socket's monitor), or a frame cannot
be queued: a control message is delivered or the session is lost.

Commits and touches (recency) are batched, not sent per call. The first commit after a quiet
period (``COMMIT_QUIET_S``) wakes the I/O thread and goes out at once. While commits flow they
need no wake-up: they go out when the host's index events arrive (the host's tick, every
``server.EVENTS_PERIOD_S``; one wake-up for both), else ``COMMIT_PERIOD_S`` after the last send.
A key stored while commits flow so reaches other tiers' copies of the index one to two event
periods later. A request made ``with_commits`` (a grant that tops up a tier's reserve) waits for
the next commits and goes out behind them, unless ``send_batched`` asks for them now. Touches go
out every ``TOUCH_PERIOD_S``, each key once (a key's recency counts only when it is the least
recently used of a whole pool).

Why so frugal: this thread shares the tier's GIL with the caller's thread, which needs it for
each store's Python and digests (NIXL's ``transfer()`` releases it while it posts). Every
wake-up's Python runs on that thread's time: measured here, a thread busy 25 % of the time in
1 ms wake-ups cut a private tier's store throughput to 0.70 of its own (a neighbour process as
busy cut nothing), and a frame per store call had this thread busy 20 %. So a wake-up looks
only at what the poller says is ready, and receives without ``recv`` raising ``zmq.Again``.

``SessionIO`` is a part of ``RemoteSession`` (its base class, over ``SessionHandoff``): the
state it uses is set by ``RemoteSession.__init__``, and its lock guards what other threads hand
over.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import socket
import time
import types
import weakref
from collections.abc import Callable
from itertools import chain
from typing import Any

import zmq

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.handshake import SNDHWM, close_sockets, disconnected
from torch_kv_tier.remote.replica import IndexFollower
from torch_kv_tier.remote.replies import Replies, Request
from torch_kv_tier.remote.session_handoff import SessionHandoff

logger = logging.getLogger(__name__)
# ``zmq.POLLIN`` is an enum member: ``&`` with it runs Python's enum code (~1 us a check)
_POLLIN = int(zmq.POLLIN)

TOUCH_PERIOD_S = 0.05  # the longest a touch waits to be sent
# While commits flow they go out when the host's index events arrive (its period's tick, every
# ``server.EVENTS_PERIOD_S``: one wake-up for both) or, without events, this long after the
# last send; a commit made at least ``COMMIT_QUIET_S`` after the last send goes out at once.
COMMIT_PERIOD_S = 0.02
COMMIT_QUIET_S = 0.005


def callback_ref(
    callback: Callable[[str], None] | None,
) -> Callable[[], Callable[[str], None] | None]:
    """A reference to ``callback`` (a session's ``on_lost``, which the I/O thread calls):
    weak for a bound method, strong for any other callable."""
    if isinstance(callback, types.MethodType):
        return weakref.WeakMethod(callback)
    return lambda: callback


class _Lost(Exception):
    """The session cannot go on (the text says why)."""


_UNKNOWN = "the server no longer knows this session (expired, ended or restart)"


class EndedByHost(ConnectionError):
    """What a request of a session fails with once its host said it no longer knows the
    session: the host ended it (its lease expired, the session was named resolved, or the
    host restarted), so a disconnect of it has nothing left to end."""


class SessionIO(SessionHandoff):
    """The I/O thread's half of ``RemoteSession`` (module docstring)."""

    public_id: str
    session_id: str
    _stopping: bool
    _interval_s: float
    _hb_timeout_s: float
    _follower: IndexFollower | None
    _usage: dict[str, int]
    _touches: list[Any]
    _wake_r: socket.socket
    _on_lost: Callable[[], Callable[[str], None] | None]

    def _io_loop(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        replies = Replies(self.peer_id, self._hb_timeout_s)
        seqs = itertools.count(3)  # (the answers to the handshake's came before its Accept)
        poller = zmq.Poller()
        wake = self._wake_r.fileno()
        for readable in (sock, monitor, wake):
            poller.register(readable, zmq.POLLIN)
        next_hb = touches_due = commits_due = time.monotonic()
        commits_sent = -math.inf  # none yet: the first commit goes out at once
        lost: str | None = None
        try:
            while True:
                now = time.monotonic()
                with self._lock:
                    stopping = self._stopping  # then it ends once what was queued went out
                    beating = not self._closed  # (for this wait; read again before a beat)
                    touched = bool(self._touches)
                    committed = bool(self._commits)
                    # While commits flow this thread looks at them by ``commits_due`` on its
                    # own, and a commit needs no wake-up (``RemoteSession.commit``).
                    self._commits_watched = committed or now < commits_sent + COMMIT_QUIET_S
                # (closed: still a bounded wait, the same cadence)
                deadlines = [next_hb if beating else now + self._interval_s, replies.heard_by()]
                if touched:
                    deadlines.append(touches_due)
                if self._commits_watched:
                    deadlines.append(commits_due)
                deadlines.extend(replies.deadlines())
                # Each wake-up holds the GIL its caller's thread needs (a tier's stores run on
                # it): only what the poller says is ready is looked at.
                wait = max(0, math.ceil((min(deadlines) - now) * 1e3))
                ready = {} if stopping else dict(poller.poll(wait))
                if wake in ready:
                    self._drain_wake()
                if monitor in ready and disconnected(monitor):
                    raise _Lost("the control connection was closed or reset")
                while not self._actions.empty():
                    self._actions.get_nowait()()
                ticked = False  # the host pushed index events: its period's tick
                for message in self._receive(sock) if sock in ready else ():
                    if isinstance(message, p.Events):
                        self._on_events(message)
                        ticked = True
                        continue
                    if isinstance(message, p.HeartbeatAck):
                        if self._follower is not None and message.event_seq >= 0:
                            self._follower.check(message.event_seq)
                    elif isinstance(message, p.Error) and message.reason == p.UNKNOWN_SESSION:
                        raise _Lost(_UNKNOWN)
                    replies.answer(message)
                now = time.monotonic()
                # Commits and touches first: a request made after them reaches the server after
                # them (a grant request must find the slots a commit returned to this session's
                # share). The requests are taken before the batches, so every commit and touch
                # made before one of them goes out ahead of it. While the host pushes events,
                # commits go out on their arrival: one wake-up for both.
                requests = self._take_requests()
                with self._lock:  # the flag: after the wake-up ``send_batched`` made, or before
                    flush, self._flush = self._flush, False
                    # Closed: no heartbeat may follow its ``Disconnect`` (the host, which ended
                    # the session, would say it is unknown: lost). Read after the take: ``close``
                    # sets ``_closed`` before it queues the ``Disconnect``, so one taken above,
                    # or sent before, is seen here.
                    beating = not self._closed
                    send = bool(requests) or now >= commits_due or ticked or flush
                    if send:  # made before the commits taken next: sent after them
                        requests[:0], self._riders = self._riders, []
                if send and self._send_commits(sock, seqs):
                    commits_sent, commits_due = now, now + COMMIT_PERIOD_S
                if requests or now >= touches_due:
                    touches_due = now + TOUCH_PERIOD_S
                    self._send_touches(sock, seqs)
                for make, future, timeout_s, on_late in requests:
                    seq = next(seqs)
                    if future is not None:
                        replies.expect(seq, future, now + timeout_s, on_late)
                    self._send(sock, make(seq))
                if stopping:  # (``close``: its ``Disconnect`` was answered, or timed out)
                    break
                now = time.monotonic()
                replies.expire(now)
                if now > replies.heard_by():
                    raise _Lost(f"no heartbeat answer for {self._hb_timeout_s:.1f} s")
                if beating and now >= next_hb:
                    next_hb = now + self._interval_s
                    with self._lock:
                        usage = dict(self._usage)
                    replies.heartbeat(seq := next(seqs), now)
                    self._send(sock, p.Heartbeat(seq, self.session_id, **usage))
        except _Lost as exc:
            lost = str(exc)
        except Exception:
            logger.exception("I/O thread of %s failed", self.peer_id)
            lost = "the session's I/O thread failed"
        finally:
            self._finish(sock, monitor, replies, lost)

    def _take_requests(self) -> list[Request]:
        """Every request queued so far, in order (this thread is their only consumer)."""
        requests = []
        while not self._requests.empty():
            requests.append(self._requests.get_nowait())
        return requests

    def _send_commits(self, sock: zmq.Socket[bytes], seqs: itertools.count[int]) -> bool:
        """The commits made since the last send, in as few frames as fit; whether there were
        any."""
        with self._lock:
            commits, self._commits = self._commits, []
        if not commits:
            return False
        keys, slots, digests = (list(chain.from_iterable(part)) for part in zip(*commits))
        self._send_chunked(sock, seqs, p.Commit, keys, slots, digests)
        if self._follower is not None:
            self._follower.on_commits(keys, slots, digests)
        return True

    def _send_touches(self, sock: zmq.Socket[bytes], seqs: itertools.count[int]) -> None:
        """The keys touched since the last time, each once, in as few frames as fit."""
        with self._lock:
            touches, self._touches = self._touches, []
        self._send_chunked(sock, seqs, p.Touch, list(dict.fromkeys(touches)))

    def _send_chunked(
        self,
        sock: zmq.Socket[bytes],
        seqs: itertools.count[int],
        make: Callable[..., p.ClientMessage],
        *columns: list[Any],
    ) -> None:
        """``make(seq, session_id, *columns)`` in as few frames as fit (``MAX_KEYS_PER_MESSAGE``
        rows each)."""
        step = p.MAX_KEYS_PER_MESSAGE
        for i in range(0, len(columns[0]), step):
            self._send(sock, make(next(seqs), self.session_id, *(c[i : i + step] for c in columns)))

    def _finish(
        self,
        sock: zmq.Socket[bytes],
        monitor: zmq.Socket[bytes],
        replies: Replies,
        lost: str | None,
    ) -> None:
        with self._lock:
            self._io_done = True
            report = lost is not None and not self._closed
            if lost is not None:
                self._lost_reason = lost
            self._wake_r.close()
            self._wake_w.close()
            riders, self._riders = self._riders, []
        failure = EndedByHost if lost == _UNKNOWN else ConnectionError
        error = failure(f"session {self.peer_id} ended: {lost or 'closed'}")
        replies.fail(error)
        for _, waiting, _, _ in riders + self._take_requests():
            if waiting is not None:
                waiting.set_exception(error)
        close_sockets(sock, monitor, linger=lost is None)  # what went out last may go on
        if report:
            logger.warning("lost %s (session %s): %s", self.peer_id, self.public_id, lost)
            on_lost = self._on_lost()
            if on_lost is not None:
                try:
                    on_lost(self.peer_id)
                except Exception:
                    logger.exception("on_lost callback for %s raised", self.peer_id)

    def _on_events(self, events: p.Events) -> None:
        """Hand pushed index events to the follower; a batch it cannot apply (a bug) is logged
        and answered with a new snapshot, instead of ending the session."""
        follower = self._follower
        if follower is None:
            return
        try:
            follower.on_events(events)
        except Exception:
            logger.exception(
                "%s: index events %d not applied: resyncing", self.peer_id, events.event_seq
            )
            follower.start()

    def _drain_wake(self) -> None:
        """Take the wake-up bytes (one ``recv``: any written after it wake the next poll)."""
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)

    def _send(self, sock: zmq.Socket[bytes], message: p.ClientMessage) -> None:
        try:
            sock.send(p.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise _Lost(f"{SNDHWM} control frames queued: the server does not read") from None

    def _receive(self, sock: zmq.Socket[bytes]) -> list[p.ServerMessage]:
        """Every frame queued (checked with ``ZMQ_EVENTS``: a ``recv`` that finds none raises,
        which cost more than the rest of a wake-up)."""
        messages: list[p.ServerMessage] = []
        while int(sock.get(zmq.EVENTS)) & _POLLIN:
            frame = sock.recv(zmq.NOBLOCK)
            try:
                messages.append(p.decode_server(frame))
            except p.BadFrame as exc:
                logger.warning("%s sent a bad control frame: %s", self.peer_id, exc)
        return messages
