"""A session's request/reply bookkeeping: which requests sent await an answer, until when, and
what an answer that comes after its request timed out is handed to.

The server answers a session's requests in order. An answer after its request's timeout is
dropped (once a later request is answered it never comes), but for a request made with a
``late`` handler (a grant, whose slots the server counts granted all the same): that one gets
it. An answer to a request nobody awaits (unknown, or timed out without a handler) is ignored.

Heartbeats are requests too: the server is silent from the first heartbeat it has not answered
(``heard_by``), not from its last answer, so a client that was paused itself (SIGSTOP, a
debugger) asks again before it calls the server silent.

Threading: ``Replies`` belongs to the session's I/O thread (``session_io``); futures resolve
there, and the callbacks added to them run there.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from torch_kv_tier.remote import protocol as p

# What an answer that came after its request's timeout is handed to
OnLate = Callable[[p.ServerMessage], None]
# a request made from any thread: build the message for a seq, the future its answer resolves
# (``None``: a message without an answer), timeout, what a late answer is handed to
Request = tuple[
    Callable[[int], p.ClientMessage], "Future[p.ServerMessage] | None", float, OnLate | None
]


class Replies:
    """The requests sent that await an answer (module docstring)."""

    def __init__(self, peer_id: str, heartbeat_timeout_s: float) -> None:
        self._peer_id = peer_id  # names the server in a timeout's error
        self._hb_timeout_s = heartbeat_timeout_s
        self._pending: dict[int, tuple[Future[p.ServerMessage], float, OnLate | None]] = {}
        self._late: dict[int, OnLate] = {}  # requests timed out whose answer is still wanted
        self._asked: deque[tuple[int, float]] = deque()  # heartbeats unanswered: (seq, sent)

    def expect(
        self, seq: int, future: Future[p.ServerMessage], deadline: float, on_late: OnLate | None
    ) -> None:
        """Request ``seq`` went out: its answer resolves ``future`` unless ``deadline`` (a
        ``time.monotonic()``) passes first; then ``on_late`` gets it, if it still comes."""
        self._pending[seq] = (future, deadline, on_late)

    def heartbeat(self, seq: int, now: float) -> None:
        """Heartbeat ``seq`` went out at ``now``."""
        self._asked.append((seq, now))

    def heard_by(self) -> float:
        """When the server, silent unless it answers the oldest heartbeat it has not answered
        by then, counts as lost (``math.inf`` while every heartbeat is answered)."""
        return self._asked[0][1] + self._hb_timeout_s if self._asked else math.inf

    def deadlines(self) -> Iterable[float]:
        """The deadline of every request awaiting its answer."""
        return (deadline for _, deadline, _ in self._pending.values())

    def answer(self, message: p.ServerMessage) -> None:
        """The server answered request ``message.seq``: resolve its future, or hand the
        message to its late handler; requests before it that are still unanswered never will
        be."""
        if isinstance(message, p.HeartbeatAck):
            while self._asked and self._asked[0][0] <= message.seq:
                self._asked.popleft()
        entry = self._pending.pop(message.seq, None)
        if entry is not None:
            entry[0].set_result(message)
        elif message.seq in self._late:
            self._late.pop(message.seq)(message)
        for seq in [s for s in self._late if s < message.seq]:
            del self._late[seq]  # answered in order: skipped, never to come

    def expire(self, now: float) -> None:
        """Fail with ``TimeoutError`` the requests whose deadline passed by ``now``; those with
        a late handler keep it, for an answer that may still come."""
        for seq in [s for s, (_, deadline, _) in self._pending.items() if deadline <= now]:
            future, _, on_late = self._pending.pop(seq)
            if on_late is not None:
                self._late[seq] = on_late
            future.set_exception(TimeoutError(f"{self._peer_id} did not answer within the timeout"))

    def fail(self, error: Exception) -> None:
        """The session ended: fail every request awaiting its answer with ``error``."""
        pending, self._pending = self._pending, {}
        self._late.clear()
        for future, _, _ in pending.values():
            future.set_exception(error)


def answer_late(
    on_answer: Callable[[Future[p.ServerMessage]], None], message: p.ServerMessage
) -> None:
    """Run ``on_answer`` with a future of ``message``, an answer that came after its request
    timed out; what it raises is logged, as for the first."""
    future: Future[p.ServerMessage] = Future()
    future.set_running_or_notify_cancel()
    future.add_done_callback(on_answer)
    future.set_result(message)
