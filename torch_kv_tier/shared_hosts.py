"""The tier's side of its shared hosts: joining one, asking it for slots and launching the stores
that waited for them, recency, and applying its index events. The per-host state (grants,
waiting stores, commits, verification) is each host's ``shared_host.SharedHost``; the copy of
its key set is the index's ``SharedSlots``.

``SharedHosts`` is a part of ``TierManager`` (its base class, beside ``Transfers`` and
``ConnectedHosts``): ``connect`` joins a shared host with ``_join_shared``; ``store`` and a
store's completion call ``_refill``; ``touch`` and a load's completion ``_touch_shared``.

Threading: methods without "(I/O thread, unlocked)" run with the manager's lock held. Answers
from the host arrive on the session's I/O thread: a grant's takes the lock itself; index events
are handed to the lock (``DeferringLock.run_soon``) and applied by whoever holds it, so the I/O
thread never waits behind a store's transfer. A request's answer callback is attached before
the request is sent, so it never runs on the caller's thread (where the lock is held and not
reentrant).

Keys a host holds on its disk only (``serve --disk``): a load of them asks the host to promote
them and parks (``promotions``) until its index events announce them in DRAM, then reads them
as any load; announced gone, or not promoted within ``promotion_timeout_s``, they are missing.

Failure model: a grant answered with no slots (or refused with an ``Error``) fails the stores
waiting for it with "capacity" only when nothing this tier does could free its share. A grant
that brings no answer (the host is silent, or no longer knows the session) says nothing about
capacity: the stores wait on, a silent host is asked again, and when the session is lost the
host is dropped and they fail "peer lost".
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING, Any, cast

from torch_kv_tier.connections import Joining
from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.index import BlockIndex
from torch_kv_tier.keys import Key
from torch_kv_tier.promotions import Parked, Promotions
from torch_kv_tier.records import Op, Peer, Request
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.replica import Commits
from torch_kv_tier.results import CAPACITY, MISSING
from torch_kv_tier.shared_host import SharedHost
from torch_kv_tier.slot_maps import SharedSlots, drain

_JOIN_POLL_S = 0.05  # how often a join waiting for the host's index looks at its session

logger = logging.getLogger(__name__)

# What a host's index events say: (stored keys, their slots, their digests, evicted keys, reset,
# with a reset this tier's commits the snapshot cannot have: ``remote.replica``)
HostChange = tuple[list[Key], list[int], list[int], list[Key], bool, Commits]


class SharedHosts:
    """Shared-host behaviour of ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    grant_batch: int
    promotion_timeout_s: float
    _cond: threading.Condition
    _promotions: Promotions
    _ops: dict[int, Op]
    _ready: list[Request]
    _lock: DeferringLock
    _closed: bool
    _stopping: bool  # set by ``close`` as it takes the peers' sessions, to end them itself
    _index: BlockIndex
    _peers: dict[str, Peer]
    _storing: dict[Key, Op]
    _joining: dict[str, Joining]  # peer id -> its connect in progress

    if TYPE_CHECKING:  # implemented by TierManager, Transfers, ConnectedHosts and LostHosts

        def _check_open(self) -> None: ...
        def _launch(self, op: Op) -> None: ...
        def _finish(self, op: Op, reason: str | None) -> None: ...
        def _submitted(self, request: Request | None, peer_ids: Iterable[str]) -> None: ...
        def _flush(self) -> None: ...
        def _register(
            self, peer_id: str, meta: bytes, base: int, num_blocks: int, block_len: int
        ) -> None: ...
        def _drop_to_end(self, peer_id: str, *, lost: bool = False) -> tuple[Any, bool]: ...
        def _end_keeping_releases(self, session: Any, clean: bool) -> None: ...
        def _flush_then_end(self, session: Any, clean: bool, *, redial: bool = False) -> None: ...
        def _ready_if_settled(self, request: Request) -> None: ...
        def _stopped_join(self, peer_id: str) -> ConnectionError | None: ...

    def _join_shared(self, session: Any, timeout_s: float) -> None:
        """Register a shared host: its NIXL region (unlocked), its key set's snapshot, then its
        first grant (in the background, after the snapshot request on the wire: no commit of
        this tier precedes the snapshot, ``SharedSlots``), then the snapshot (awaited).

        On failure (raised) the session is ended, clean unless a store to the host is in flight
        (stores may go out before the snapshot is in), and the host dropped; the ended sessions
        it released that the host may not have read are kept to be told again; the caller's
        dial stays, so that a redial goes on. A host the user removed (or whose dial was
        cancelled) as it registered is never published (``ConnectionError``,
        ``_stopped_join``). A host dropped while it waits for the snapshot
        (``remove_peer``/``disconnect``, or its session lost) ends the wait at once
        (``ConnectionError``): whoever dropped it ended its session; so does a dial cancelled
        meanwhile (``cancel_dial``), and the host is dropped then."""
        peer_id = session.peer_id
        try:
            self._register(
                peer_id,
                session.agent_metadata,
                session.base_addr,
                session.num_blocks,
                session.block_len,
            )
        except BaseException:
            self._end_keeping_releases(session, True)  # nothing of it published: none written
            raise
        synced, stopped = threading.Event(), threading.Event()
        host = lost = None
        with self._lock:
            if peer_id in self._joining:  # (not so a test's join)
                stopped = self._joining[peer_id].stopped
            removed = None if self._closed else self._stopped_join(peer_id)
            if not self._closed and removed is None:
                slots = self._index.add_shared_peer(peer_id, session.num_blocks)
                host = self._peers[peer_id] = SharedHost(slots, session, self.grant_batch)
                try:
                    session.follow(_HostChanges(self, host, synced))
                except ConnectionError as exc:  # the session ended already: dropped below
                    lost = exc
                else:
                    self._refill(host)
        if removed is not None:
            self._end_keeping_releases(session, True)  # never published: none written
            raise removed
        if host is None:
            session.close(clean=True)
            self._check_open()  # raises: the tier closed
        try:
            if lost is not None:
                raise lost
            deadline = time.monotonic() + timeout_s
            while not synced.wait(min(_JOIN_POLL_S, max(deadline - time.monotonic(), 0))):
                if session.lost is not None:
                    raise ConnectionError(f"{peer_id} was lost before it sent its index")
                if self._peers.get(peer_id) is not host or stopped.is_set():  # (no lock needed)
                    raise ConnectionError(
                        f"{peer_id} was removed (disconnect, remove_peer, cancel_dial) or "
                        "dropped before it sent its index; connect it again to join it"
                    )
                self._check_open()  # closed meanwhile (its session ended clean, not lost)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{peer_id} did not send its index within {timeout_s} s")
        except BaseException:
            # unless the session's loss dropped it (and ends the session), or ``close`` took it
            with self._lock:
                ended = None
                if self._peers.get(peer_id) is host and not self._stopping:
                    ended = self._drop_to_end(peer_id, lost=session.lost is not None)
            if ended is not None:
                self._flush_then_end(*ended)
            raise

    def _refill(self, host: SharedHost) -> None:
        """Ask ``host`` for the slots it wants (``SharedHost.grant_wanted``); the answer lands
        in ``_on_granted``, on the session's I/O thread."""
        want, low = host.grant_wanted(), host.running_low()
        try:
            if not want:
                if host.refilling and low:
                    host.session.send_batched()  # a top-up waiting for the next commits
                return
            # a top-up goes out with the next commits; stores waiting for slots ask at once
            host.session.grant(
                want, partial(self._on_granted, host, host.commits, want), with_commits=not low
            )
        except ConnectionError:
            return  # the session is ending; its loss drops the peer
        host.refilling = True

    def _on_granted(self, host: SharedHost, commits: int, want: int, future: Future[Any]) -> None:
        """A grant answer (I/O thread, unlocked): stores waiting for slots go out, or fail
        with "capacity" when nothing this tier does could free its share. A request that timed
        out comes here twice: with the ``TimeoutError``, then with its late answer, whose slots
        are this tier's all the same (``RemoteSession.grant``)."""
        try:
            answer = future.result()
        except Exception as exc:  # no answer in time, or the session closed
            answer = exc
        if isinstance(answer, p.Error):  # a refusal: no slots (``Error(UNKNOWN_SESSION)`` ends
            # the session before it reaches here, ``session_io``)
            logger.warning("%s refused a grant: %s", host.slots.peer_id, answer.reason)
            granted: list[int] = []
        elif isinstance(answer, p.Granted):
            granted = answer.slots
        else:
            self._on_grant_unanswered(host, answer)
            return
        with self._lock:
            if self._closed or self._peers.get(host.slots.peer_id) is not host:
                host.refilling = False
                return
            host.granted(granted, want, commits)
            launched = self._launch_awaiting(host)
            if host.starved(bool(granted), commits, self._ops.values()):
                self._fail_awaiting(host, CAPACITY)
            if not host.capped:  # a capped tier asks again after its next commit
                self._refill(host)
            # the stores launched may have completed in their submission (a top-up launches
            # none: this thread's time is the stores' GIL time, see ``session_io``)
            self._submitted(None, [host.slots.peer_id] if launched else [])
        self._flush()  # (a KeyboardInterrupt as the lock is released loses none)

    def _on_grant_unanswered(self, host: SharedHost, answer: object) -> None:
        """A grant request that brought no answer (I/O thread, unlocked): the host went
        silent, the session ended, or it answered with something else than a grant. That says
        nothing about capacity, so the stores waiting stay, bounded by the session's fate: a
        host whose session lives is asked again (a late answer still brings its slots,
        ``_on_granted``), and a session lost meanwhile (the heartbeat's verdict, or the host's
        ``Error(UNKNOWN_SESSION)``) drops the host and fails them "peer lost"."""
        logger.warning("grant from %s brought no answer: %r", host.slots.peer_id, answer)
        with self._lock:
            host.refilling = False
            alive = host.session.lost is None and not self._closed
            if alive and self._peers.get(host.slots.peer_id) is host:
                self._refill(host)

    def _launch_awaiting(self, host: SharedHost) -> bool:
        """Launch the waiting stores that granted slots now cover; whether there were any."""
        launched = False
        for op, rest in host.launchable():
            if rest is not None:
                self._storing.update(dict.fromkeys(rest.keys, rest))
            self._launch(op)
            launched = True
        return launched

    def _fail_awaiting(self, peer: Peer, reason: str) -> None:
        if isinstance(peer, SharedHost):
            for op in peer.take_awaiting():
                self._finish(op, reason)

    def _touch_shared(self, groups: dict[SharedSlots, list[Key]]) -> None:
        """Report recency to shared hosts (batched by their sessions)."""
        for slots, keys in groups.items():
            self._peers[slots.peer_id].touch(keys)  # type: ignore[attr-defined]

    def _on_host_changes(self, host: SharedHost, change: HostChange) -> None:
        """A shared host's key set changed (I/O thread, unlocked). Applied under the lock
        without waiting for it: now when it is free, else by its holder before it releases it
        (a store holds it through its transfer), so every later call sees it. A snapshot
        (``reset``) is applied before this returns: joining waits for it."""
        apply = partial(self._apply_host_changes, host, change)
        if change[4]:
            self._lock.run_now(apply)
        else:
            self._lock.run_soon(apply)

    def _apply_host_changes(self, host: SharedHost, change: HostChange) -> None:
        """(Lock held.) Changes of a host dropped or joined again meanwhile are ignored; a batch
        that cannot be applied (a bug) is logged and the host asked for a new snapshot."""
        if self._peers.get(host.slots.peer_id) is not host:
            return
        stored, slots, digests, evicted, reset, sent = change
        if reset:  # nor can a snapshot have the commits not sent yet (made under this lock)
            sent = [*sent, *host.session.unsent_commits()]
        try:
            self._index.apply_host_changes(
                host.slots,  # type: ignore[arg-type]
                stored,
                slots,
                digests,
                evicted,
                reset,
                sent,
            )
        except Exception:
            logger.exception("%s: index changes not applied: resyncing", host.slots.peer_id)
            host.session.resync()
        if host.promoting:  # keys the host announced (in DRAM, or on disk again) were promoted
            drain(map(host.promoting.pop, stored, repeat(None)))
        if self._promotions.waiting_on(host.slots.peer_id):
            self._resume_promoted(host)

    # -- keys on a host's disk ------------------------------------------------------------

    def _promote(self, keys: list[Key]) -> dict[SharedHost, list[Key]]:
        """Ask the hosts holding ``keys`` on disk to promote them; the keys whose promotion is
        awaited, by host."""
        now, awaited = time.monotonic(), {}
        for slots, positions in self._index.on_disk(keys).items():
            host = self._peers[slots.peer_id]
            assert isinstance(host, SharedHost)
            waiting = host.promote([keys[i] for i in positions], now, self.promotion_timeout_s)
            if waiting:
                awaited[host] = waiting
        return awaited

    def _park_on_disk(
        self, request: Request, keys: list[Key], local: list[int], missing: list[Key]
    ) -> list[Key]:
        """Park the load of those ``missing`` keys a host holds on disk until it promoted them;
        returns the keys really missing."""
        awaited = self._promote(missing)
        if not awaited:
            return missing
        local_of = dict(zip(keys, local))
        deadline = time.monotonic() + self.promotion_timeout_s
        parked: set[Key] = set()
        for host, waiting in awaited.items():
            self._promotions.park(
                host.slots.peer_id,
                Parked(request, waiting, [local_of[k] for k in waiting], deadline),
            )
            parked.update(waiting)
        self._cond.notify()  # an idle poller looks at the parked loads' deadlines again
        return [k for k in missing if k not in parked]

    def _resume_promoted(self, host: SharedHost) -> None:
        """(Lock held.) ``host``'s key set changed: read the parked keys it now has in DRAM,
        fail those it no longer holds, park the rest again."""
        peer_id = host.slots.peer_id
        for waiting in self._promotions.take(peer_id):
            groups, missing = self._index.locate(waiting.keys, waiting.local)
            for slots, (gkeys, glocal, remote, digests) in groups.items():
                peer = self._peers[slots.peer_id]
                self._launch(
                    Op("load", slots.peer_id, peer, gkeys, glocal, remote, waiting.request, digests)
                )
            on_disk = self._index.on_disk(missing).get(cast(SharedSlots, host.slots), [])
            still = [missing[i] for i in on_disk]
            if still:
                local_of = dict(zip(waiting.keys, waiting.local))
                local = [local_of[k] for k in still]
                self._promotions.park(
                    peer_id, Parked(waiting.request, still, local, waiting.deadline)
                )
                kept = set(still)
                missing = [k for k in missing if k not in kept]
            waiting.request.settle(missing, MISSING)
            self._ready_if_settled(waiting.request)
        if self._ops or self._ready:
            self._cond.notify()

    def _fail_parked(self, parked: list[Parked], reason: str) -> None:
        for waiting in parked:
            waiting.request.settle(waiting.keys, reason)
            self._ready_if_settled(waiting.request)


class _HostChanges:
    """The ``on_change`` a shared session calls: forwards to its tier and its ``SharedHost``,
    both held weakly (the tier owns the session; a strong reference would be a cycle keeping
    the tier's NIXL agent alive until the garbage collector runs), and marks the first
    snapshot."""

    def __init__(self, tier: SharedHosts, host: SharedHost, synced: threading.Event) -> None:
        self._tier = weakref.ref(tier)
        self._host = weakref.ref(host)
        self._synced = synced

    def __call__(
        self,
        stored: list[Key],
        slots: list[int],
        digests: list[int],
        evicted: list[Key],
        reset: bool,
        sent: Commits,
    ) -> None:
        tier, host = self._tier(), self._host()
        if tier is not None and host is not None:
            tier._on_host_changes(host, (stored, slots, digests, evicted, reset, sent))
        if reset:
            self._synced.set()


__all__ = ["SharedHosts"]
