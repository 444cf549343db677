"""A shared session's requests: grants, commits, touches, promotions, and following the host's
index (``replica``).

``SharedRequests`` is a part of ``RemoteSession`` (its base class, over ``SessionIO``, whose
``SessionHandoff`` carries the requests to the I/O thread). Every method may be called from any
thread; answers resolve, and ``on_answer``/``on_change`` run, on the session's I/O thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.replica import IndexFollower, OnChange
from torch_kv_tier.remote.replies import answer_late
from torch_kv_tier.remote.session_handoff import add_to_batch
from torch_kv_tier.remote.session_io import SessionIO


class SharedRequests(SessionIO):
    """A shared session's half of ``RemoteSession`` (module docstring)."""

    shared: bool
    num_blocks: int

    def grant(
        self,
        want: int,
        on_answer: Callable[[Future[p.ServerMessage]], None],
        *,
        with_commits: bool = False,
    ) -> None:
        """Ask for up to ``want`` slots only this session may write; ``on_answer`` gets the
        future of the ``Granted`` answer, on the I/O thread (never on the caller's). An answer
        that comes after the timeout runs ``on_answer`` again, with a future of it: the host
        counts those slots granted to this session (against its ``max_granted``) until it
        commits them, so they must not go unused. ``with_commits``: a top-up that can wait for
        the next batch of commits (sent with it, without a wake-up of its own, while commits
        flow)."""
        self._call_async(
            lambda seq: p.GrantRequest(seq, self.session_id, want),
            on_answer,
            with_commits=with_commits,
            late=partial(answer_late, on_answer),
        )

    def commit(self, keys: list[Any], slots: list[int], digests: list[int]) -> None:
        """Publish ``keys``, whose writes of bytes with ``digests`` into granted ``slots``
        completed (no answer; batched with other commits into as few frames as possible)."""
        # The batch is looked up under the lock, inside ``_enqueue``: the I/O thread swaps in a
        # new list each time it takes one, and a list taken before the lock could already be
        # sent (the commit was lost: the host kept the slots granted, the keys never stored).
        self._enqueue(lambda: self._add_commit((keys, slots, digests)), False)

    def touch(self, keys: list[Any]) -> None:
        """Report ``keys`` recently used (no answer; sent at most ``session_io.TOUCH_PERIOD_S``
        later, batched with every other touch of that period)."""
        self._enqueue(lambda: add_to_batch(self._touches, keys), False)

    def promote(self, keys: list[Any]) -> None:
        """Ask the host to bring ``keys``, which it announced on its disk, into DRAM slots (no
        answer: it announces them stored once they are; sent at once)."""
        for i in range(0, len(keys), p.MAX_KEYS_PER_MESSAGE):
            chunk = keys[i : i + p.MAX_KEYS_PER_MESSAGE]
            self._post(partial(p.Promote, session_id=self.session_id, keys=chunk))

    def follow(self, on_change: OnChange) -> None:
        """Keep ``on_change(stored, slots, digests, evicted, reset, sent)`` informed of the
        namespace's key set: a snapshot first (``reset=True``, with this session's commits the
        snapshot cannot have: ``replica``), then every change, on the I/O thread (where the
        snapshot is started too, so no event is applied before it)."""
        if not self.shared:
            raise ValueError(f"{self.peer_id} is a private lease: there is no shared index")

        def request_page(
            cursor: int,
            on_page: Callable[[Future[p.ServerMessage]], None],
            on_sent: Callable[[], None],
        ) -> None:
            def make(seq: int) -> p.SnapshotRequest:
                on_sent()
                return p.SnapshotRequest(seq, self.session_id, cursor)

            self._call_async(make, on_page)

        follower = IndexFollower(request_page, on_change, host=self.peer_id, pool=self.num_blocks)

        def start() -> None:
            self._follower = follower
            follower.start()

        self._enqueue_action(start)

    def resync(self) -> None:
        """Take a new snapshot of the followed index (thread-safe; for a follower whose copy
        could not apply a change)."""
        follower = self._follower
        if follower is not None:
            self._enqueue_action(follower.start)
