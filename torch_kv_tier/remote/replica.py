"""``IndexFollower``: keeps a client's copy of a shared host's key set current.

The host pushes ``Events`` batches, numbered per namespace. The follower starts with a paged
snapshot (buffering the events that arrive meanwhile), then applies each batch in order. A gap
in the numbering (the host dropped frames for a slow client) triggers a new snapshot. The
copy's owner sees every change through ``on_change(stored, evicted, reset)``: ``reset=True``
means ``stored`` is the whole key set and everything else is gone.

A stale copy only ever costs a miss: a load pins its keys on the host first and a key the
host no longer has is reported missing, never read.

Threading: every method runs on the session's I/O thread (events and snapshot pages arrive
there), so the follower needs no lock; ``on_change`` runs on that thread too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torch_kv_tier.remote import protocol as p

logger = logging.getLogger(__name__)

OnChange = Callable[[list[Any], list[Any], bool], None]


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
        self._pages: list[Any] = []
        self._buffer: list[p.Events] = []

    def start(self) -> None:
        """Take a snapshot (again); events arriving meanwhile are buffered."""
        self.syncing = True
        self._pages, self._buffer = [], []
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
            self._on_change(events.stored, events.evicted, False)

    def _request(self, cursor: int) -> None:
        with contextlib.suppress(ConnectionError):  # the session is over: nothing to follow
            self._request_page(cursor, self._on_page)

    def _on_page(self, future: Future[p.ServerMessage]) -> None:
        try:
            page = future.result()
        except (ConnectionError, TimeoutError) as exc:
            logger.warning("index snapshot failed (%s): retrying", exc)
            self._pages = []
            self._request(0)
            return
        if not isinstance(page, p.SnapshotPage):
            logger.warning("index snapshot refused: %s", page)
            self.syncing = False
            return
        self._pages.extend(page.keys)
        if page.next_cursor >= 0:
            self._request(page.next_cursor)
            return
        keys, buffered = self._pages, self._buffer
        self._pages, self._buffer = [], []
        self.syncing = False
        self.event_seq = page.event_seq
        self.snapshots += 1
        self._on_change(keys, [], True)
        for events in buffered:
            self.on_events(events)
