"""``IndexFollower``: keeps a client's copy of a shared host's key set current.

The host pushes ``Events`` batches, numbered per namespace. The follower starts with a paged
snapshot (buffering the events that arrive meanwhile), then applies each batch in order. A gap
in the numbering, or a heartbeat answer naming a batch it never got (``check``), triggers a new
snapshot. The copy's owner sees every change through ``on_change(stored, slots, digests,
evicted, reset)``: ``reset=True`` means ``stored`` is the whole key set and everything else is
gone. A stale copy only ever costs a miss: a load checks the bytes it read against the digest,
so a slot that was rewritten meanwhile is reported missing, never served.

Threading: every method runs on the session's I/O thread (events, snapshot pages and heartbeat
answers arrive there, and ``RemoteSession.follow`` starts the follower there), so the follower
needs no lock; ``on_change`` runs on that thread too. Each snapshot is a chain of page requests
with its own number: a page of an older chain (superseded by a resync) is ignored.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torch_kv_tier.remote import protocol as p

logger = logging.getLogger(__name__)

OnChange = Callable[[list[Any], list[int], list[int], list[Any], bool], None]


class IndexFollower:
    """Follows one shared session's namespace (module docstring)."""

    def __init__(
        self,
        request_page: Callable[[int, Callable[[Future[p.ServerMessage]], None]], object],
        on_change: OnChange,
    ) -> None:
        self._request_page = request_page
        self._on_change = on_change
        self.event_seq = 0
        self.syncing = False
        self.snapshots = 0  # snapshots completed (1 + resyncs)
        self._chain = 0  # number of the snapshot in progress
        self._behind = -1  # a pushed batch a heartbeat answer named that had not arrived
        self._pages: list[p.SnapshotPage] = []
        self._buffer: list[p.Events] = []

    def start(self) -> None:
        """Take a snapshot (again); events arriving meanwhile are buffered."""
        self.syncing = True
        self._chain += 1
        self._pages, self._buffer, self._behind = [], [], -1
        self._request(0)

    def on_events(self, events: p.Events) -> None:
        if self.syncing:
            self._buffer.append(events)
        elif events.event_seq <= self.event_seq:
            return  # already in the snapshot
        elif events.event_seq != self.event_seq + 1:
            logger.info(
                "index events %d..%d missed: taking a new snapshot",
                self.event_seq + 1,
                events.event_seq - 1,
            )
            self.start()
        else:
            self.event_seq = events.event_seq
            self._on_change(events.stored, events.slots, events.digests, events.evicted, False)

    def check(self, host_event_seq: int) -> None:
        """A heartbeat answer: the host had pushed batches up to ``host_event_seq``. A batch
        the previous answer named and that still has not arrived was lost: resync."""
        if self.syncing:
            return
        if self._behind >= 0 and self.event_seq < self._behind:
            logger.info("index events up to %d never arrived: taking a new snapshot", self._behind)
            self.start()
            return
        self._behind = host_event_seq if host_event_seq > self.event_seq else -1

    def _request(self, cursor: int) -> None:
        chain = self._chain
        with contextlib.suppress(ConnectionError):  # the session is over: nothing to follow
            self._request_page(cursor, lambda future: self._on_page(chain, future))

    def _on_page(self, chain: int, future: Future[p.ServerMessage]) -> None:
        if chain != self._chain:
            return  # a resync started a newer snapshot
        try:
            page = future.result()
        except (ConnectionError, TimeoutError) as exc:
            logger.warning("index snapshot failed (%s): retrying", exc)
            self.start()
            return
        if not isinstance(page, p.SnapshotPage):
            logger.warning("index snapshot refused: %s", page)
            self.syncing = False
            return
        self._pages.append(page)
        if page.next_cursor >= 0:
            self._request(page.next_cursor)
            return
        pages, buffered = self._pages, self._buffer
        self._pages, self._buffer = [], []
        self.syncing = False
        self.event_seq = page.event_seq
        self.snapshots += 1
        self._on_change(
            list(itertools.chain.from_iterable(pg.keys for pg in pages)),
            list(itertools.chain.from_iterable(pg.slots for pg in pages)),
            list(itertools.chain.from_iterable(pg.digests for pg in pages)),
            [],
            True,
        )
        for events in buffered:
            self.on_events(events)
