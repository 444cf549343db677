"""``IndexFollower``: keeps a client's copy of a shared host's key set current.

The host pushes ``Events`` batches, numbered per namespace. The follower starts with a paged
snapshot (buffering the events that arrive meanwhile), then applies each batch in order. A gap
in the numbering, or a heartbeat answer naming a batch it never got (``check``), triggers a new
snapshot. The copy's owner sees every change through ``on_change(stored, slots, digests,
evicted, reset, sent)``: ``reset=True`` means ``stored`` is the whole key set and everything
else is gone, but for ``sent``, the batches of this session's commits that went out after the
snapshot's first request (``on_commits`` hears of every commit sent). The host took the
snapshot before it read them, so they are not in it, and their echo comes later: a copy
replaced by the snapshot alone would hide them meanwhile (a load would miss a key its store
just reported stored). Recording starts when that request is sent, not when the snapshot is
decided, so a commit made before the decision but sent after the request is kept too, and none
the snapshot already has is; the commits not sent yet when the snapshot is applied are the
owner's to keep (``SessionHandoff.unsent_commits``). A stale copy only ever costs a miss: a
load checks the bytes it read against the digest, so a slot that was rewritten meanwhile is
reported missing, never served.

A key announced where this copy cannot hold it (a slot outside the pool the host told the
session of, other than ``ON_DISK``, or a digest that is no unsigned 64-bit one: a faulty host,
or one of another version) is left out of the copy, so it misses, and logged once per
announcement; a new snapshot would only bring it again. So is something announced stored or
evicted that is no key at all (not bytes, str or int: a list the copy could not even hash, a
float or bool that would pass for an int key): the copy never holds it, nothing else of the
announcement is lost.

Threading: every method runs on the session's I/O thread (events, snapshot pages and heartbeat
answers arrive there, and ``RemoteSession.follow`` starts the follower there), so the follower
needs no lock; ``on_change`` runs on that thread too. Each snapshot is a chain of page requests
with its own number: a page of an older chain (superseded by a resync) is ignored, and a page
whose next cursor does not advance past the one asked for ends the chain, refused (a faulty
host would otherwise be asked for ever; a gap in the events then asks for a new snapshot).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import reprlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from torch_kv_tier.remote import protocol as p

logger = logging.getLogger(__name__)

_MAX_DIGEST = (1 << 64) - 1
_KEY_TYPES = frozenset({bytes, str, int})  # what a wire key decodes to (``protocol.WireKey``)

# Batches of this session's commits, each (keys, slots, digests)
Commits = Sequence[tuple[Sequence[Any], Sequence[int], Sequence[int]]]
OnChange = Callable[[list[Any], list[int], list[int], list[Any], bool, Commits], None]
# request_page(cursor, on_page, on_sent): on_sent() runs on the I/O thread as the request goes out
RequestPage = Callable[[int, Callable[[Future[p.ServerMessage]], None], Callable[[], None]], object]


class IndexFollower:
    """Follows one shared session's namespace (module docstring)."""

    def __init__(
        self, request_page: RequestPage, on_change: OnChange, *, host: str, pool: int
    ) -> None:
        """``host`` names the host in logs; ``pool`` is its number of slots."""
        self._request_page = request_page
        self._on_change = on_change
        self._host = host
        self._pool = pool
        self.event_seq = 0
        self.syncing = False
        self.snapshots = 0  # snapshots completed (1 + resyncs)
        self._chain = 0  # number of the snapshot in progress
        self._behind = -1  # a pushed batch a heartbeat answer named that had not arrived
        self._pages: list[p.SnapshotPage] = []
        self._buffer: list[p.Events] = []
        self._sent: list[tuple[Any, Any, Any]] | None = None  # sent since the first request

    def start(self) -> None:
        """Take a snapshot (again); events arriving meanwhile are buffered."""
        self.syncing = True
        self._chain += 1
        self._pages, self._buffer, self._behind, self._sent = [], [], -1, None
        self._request(0)

    def on_commits(self, keys: list[Any], slots: list[int], digests: list[int]) -> None:
        """This session just sent these commits to the host."""
        if self._sent is not None:
            self._sent.append((keys, slots, digests))

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
            stored, slots, digests, refused = self._holdable(
                events.stored, events.slots, events.digests
            )
            evicted = self._keys_only(events.evicted)
            evicted = [*evicted, *refused] if refused else evicted
            self._on_change(stored, slots, digests, evicted, False, ())

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
            self._request_page(
                cursor,
                lambda future: self._on_page(chain, cursor, future),
                lambda: self._on_request_sent(chain, cursor),
            )

    def _on_request_sent(self, chain: int, cursor: int) -> None:
        if chain == self._chain and cursor == 0:
            self._sent = []  # every commit sent from now on reaches the host after the snapshot

    def _on_page(self, chain: int, cursor: int, future: Future[p.ServerMessage]) -> None:
        if chain != self._chain:
            return  # a resync started a newer snapshot
        try:
            page = future.result()
        except (ConnectionError, TimeoutError) as exc:
            logger.warning("index snapshot failed (%s): retrying", exc)
            self.start()
            return
        if not isinstance(page, p.SnapshotPage) or 0 <= page.next_cursor <= cursor:
            why = "its pages do not advance" if isinstance(page, p.SnapshotPage) else page
            logger.warning("index snapshot of %s refused: %s", self._host, why)
            self.syncing, self._sent = False, None
            return
        self._pages.append(page)
        if page.next_cursor >= 0:
            self._request(page.next_cursor)
            return
        pages, buffered, sent = self._pages, self._buffer, self._sent or []
        self._pages, self._buffer, self._sent = [], [], None
        self.syncing = False
        self.event_seq = page.event_seq
        self.snapshots += 1
        # each page checked on its own: one with a slot too few would shift the next pages'
        # keys onto their neighbours' slots and digests (wrong bytes that pass the check)
        held = [self._holdable(pg.keys, pg.slots, pg.digests) for pg in pages]
        stored, slots, digests = (
            list(itertools.chain.from_iterable(part[i] for part in held)) for i in range(3)
        )
        self._on_change(stored, slots, digests, [], True, sent)
        for events in buffered:
            self.on_events(events)

    def _holdable(
        self, keys: list[Any], slots: list[int], digests: list[int]
    ) -> tuple[list[Any], list[int], list[int], list[Any]]:
        """The announced ``(keys, slots, digests)`` this copy can hold, and the keys it cannot
        (module docstring; not what is no key: the copy never had it), which are logged. One
        pass of ``min``/``max`` when all are good."""
        n, pool = len(keys), self._pool
        if (
            len(slots) == n == len(digests)
            and _KEY_TYPES.issuperset(set(map(type, keys)))
            and (
                not n
                or (
                    min(slots) >= p.ON_DISK
                    and max(slots) < pool
                    and min(digests) >= 0
                    and max(digests) <= _MAX_DIGEST
                )
            )
        ):
            return keys, slots, digests, []
        good = [
            i
            for i, key, slot, digest in zip(range(n), keys, slots, digests)
            if type(key) in _KEY_TYPES and p.ON_DISK <= slot < pool and 0 <= digest <= _MAX_DIGEST
        ]
        kept = set(good)
        refused = [key for i, key in enumerate(keys) if i not in kept and type(key) in _KEY_TYPES]
        first = next((i for i in range(n) if i not in kept), n)
        if first >= min(len(slots), len(digests)):
            why = f"{len(slots)} slots and {len(digests)} digests for {n} keys"
        elif type(keys[first]) not in _KEY_TYPES:
            why = _no_key(keys[first])
        elif not p.ON_DISK <= slots[first] < pool:
            why = f"key {keys[first]!r} in slot {slots[first]}, outside its pool of {pool} slots"
        else:
            why = f"key {keys[first]!r} with digest {digests[first]}, no unsigned 64-bit one"
        logger.error(
            "%s announced %d keys this tier cannot hold (%s): left out of its copy of the "
            "host's index, so they miss; is the host faulty, or of another version?",
            self._host,
            n - len(good),
            why,
        )
        return (
            [keys[i] for i in good],
            [slots[i] for i in good],
            [digests[i] for i in good],
            refused,
        )

    def _keys_only(self, keys: list[Any]) -> list[Any]:
        """``keys`` (announced evicted) without what is no key, which is logged."""
        if _KEY_TYPES.issuperset(set(map(type, keys))):
            return keys
        good = [key for key in keys if type(key) in _KEY_TYPES]
        first = next(key for key in keys if type(key) not in _KEY_TYPES)
        logger.error(
            "%s announced %d evicted keys this tier cannot hold (%s): ignored; is the host "
            "faulty, or of another version?",
            self._host,
            len(keys) - len(good),
            _no_key(first),
        )
        return good


def _no_key(value: object) -> str:
    """Why ``value``, announced as a key, is none (its repr cut short: a host may send a lot)."""
    return f"{reprlib.repr(value)}, a {type(value).__name__}, is no key: keys are bytes, str or int"
