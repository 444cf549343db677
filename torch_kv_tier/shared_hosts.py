"""The tier's half of a shared remote host: granted slots, commits, pinned reads, and the
copy of the host's key set (the host's half is ``remote.shared_cache``).

``SharedHosts`` is a part of ``TierManager`` (its base class), kept in its own file because it is
one concept: how a tier uses a host whose index the host owns. It uses the manager's lock and
tables, and the manager's ``_launch``/``_after_submit``/``_ready_if_settled`` to submit and
settle transfers; the manager calls ``_join_shared`` from ``connect``, ``_refill``/``_commit``
from ``store`` and ``_finish``, ``_pin``/``_unpin`` from ``load`` and ``_finish``.

Threading: methods without "(I/O thread, unlocked)" run with the manager's lock held. Answers
from the host (grants, pins, index events) arrive on the session's I/O thread, which takes the
lock itself; a request's answer callback is attached before the request is sent, so it never
runs on the caller's thread (where the lock is held and not reentrant).

Failure model: a grant that does not come leaves the stores waiting for it to fail with
"capacity" only when nothing this tier does could free its share; a pin that does not come (the
host died) fails its keys with "peer lost" when the session ends; a read that finished after
``_PIN_MARGIN`` of its pin's TTL is reported "missing", since its slot may have been evicted
and rewritten meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from torch_kv_tier.index import BlockIndex, SharedSlots
from torch_kv_tier.keys import Key
from torch_kv_tier.records import Op, Peer, Request, resolve
from torch_kv_tier.results import CAPACITY, CLOSED, MISSING, PEER_LOST
from torch_kv_tier.transport.base import DataTransport

logger = logging.getLogger(__name__)

MAX_GRANT = 4096  # the most slots one grant request asks a shared host for
_PIN_MARGIN = 0.8  # a shared read must finish within this fraction of its pin's TTL


class SharedHosts:
    """Shared-host behaviour of ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    grant_batch: int
    transport: DataTransport
    _lock: threading.Lock
    _closed: bool
    _index: BlockIndex
    _peers: dict[str, Peer]
    _pins_expired: int

    if TYPE_CHECKING:  # implemented by TierManager

        def _check_open(self) -> None: ...
        def _launch(self, op: Op) -> None: ...
        def _after_submit(
            self, request: Request | None, peer_ids: Iterable[str]
        ) -> list[Request]: ...
        def _ready_if_settled(self, request: Request) -> None: ...
        def _track_store(self, op: Op) -> None: ...
        def remove_peer(self, peer_id: str) -> None: ...

    def _join_shared(self, session: Any, timeout_s: float) -> None:
        """Register a shared host: its NIXL region, its first grant (in the background), then
        its key set (awaited)."""
        peer_id = session.peer_id
        registered = False
        try:
            with self._lock:
                self._check_open()
                self.transport.add_remote_peer(
                    peer_id,
                    session.agent_metadata,
                    session.base_addr,
                    session.num_blocks,
                    session.block_len,
                )
                peer = self._peers[peer_id] = Peer(
                    self._index.add_shared_peer(peer_id, session.num_blocks)
                )
                peer.session = session
                registered = True
                self._refill(peer)
            synced = threading.Event()
            session.follow(_HostChanges(self, peer_id, synced))
            if not synced.wait(timeout_s):
                raise TimeoutError(f"{peer_id} did not send its index within {timeout_s} s")
        except BaseException:
            if registered:
                self.remove_peer(peer_id)
            else:
                session.close()
            raise

    def _refill(self, peer: Peer) -> None:
        """Ask the host for more slots when fewer than half a batch are left, or stores wait
        for slots; the answer lands in ``_on_granted``, on the session's I/O thread."""
        slots = peer.slots
        assert isinstance(slots, SharedSlots)
        need = sum(len(keys) for _, keys, _ in peer.awaiting)
        if slots.refilling or (not need and len(slots.grants) >= self.grant_batch // 2):
            return
        want = min(max(self.grant_batch, 2 * need), MAX_GRANT)
        try:
            peer.session.grant(want, partial(self._on_granted, peer, slots.commits))
        except ConnectionError:
            return  # the session is ending; the heartbeat thread drops the peer
        slots.refilling = True

    def _on_granted(self, peer: Peer, commits: int, future: Future[Any]) -> None:
        """A grant answer (I/O thread, unlocked): stores waiting for slots go out. With no
        slot granted, none of this tier's writes to the host in flight and no commit sent since
        the request (either would make room in its share), they fail with "capacity"."""
        try:
            granted = future.result().slots
        except Exception as exc:
            logger.warning("grant from %s failed: %s", peer.slots.peer_id, exc)
            granted = []
        with self._lock:
            slots = peer.slots
            assert isinstance(slots, SharedSlots)
            slots.refilling = False
            if self._closed or self._peers.get(slots.peer_id) is not peer:
                return
            slots.grants.extend(granted)
            self._launch_awaiting(peer)
            busy = peer.inflight or peer.queue or slots.commits != commits
            if peer.awaiting and not granted and not busy:
                self._fail_awaiting(peer, CAPACITY)
            self._refill(peer)
            ready = self._after_submit(None, [slots.peer_id])
        resolve(ready)

    def _launch_awaiting(self, peer: Peer) -> None:
        """Send waiting stores into the slots granted so far (in order, split as needed)."""
        slots = peer.slots
        while peer.awaiting and slots.grants:  # type: ignore[union-attr]
            request, keys, local = peer.awaiting.popleft()
            remote = self._index.reserve(slots, len(keys))
            n = len(remote)
            if n < len(keys):
                peer.awaiting.appendleft((request, keys[n:], local[n:]))
            op = Op("store", slots.peer_id, peer, keys[:n], local[:n], remote, request)
            self._launch(op)
            self._track_store(op)

    def _fail_awaiting(self, peer: Peer, reason: str) -> None:
        while peer.awaiting:
            request, keys, _ = peer.awaiting.popleft()
            request.settle(keys, reason)
            self._ready_if_settled(request)

    def _commit(self, peer: Peer, keys: list[Key], slots: list[int]) -> None:
        """Publish written keys on the host; that returns their slots from this tier's share
        of grants, so stores waiting for slots may ask again."""
        peer.slots.commits += 1  # type: ignore[union-attr]
        with contextlib.suppress(ConnectionError):  # the session is ending
            peer.session.commit(keys, slots)
        if peer.awaiting:
            self._refill(peer)

    def _touch_shared(self, groups: dict[SharedSlots, list[Key]]) -> None:
        for slots, keys in groups.items():
            with contextlib.suppress(ConnectionError):  # the session is ending
                self._peers[slots.peer_id].session.touch(keys)

    def _pin(self, peer: Peer, keys: list[Key], local: list[int], request: Request) -> None:
        """Ask the host to pin ``keys`` for a read; ``_on_pinned`` submits it."""
        from torch_kv_tier.remote.protocol import MAX_KEYS_PER_MESSAGE

        for i in range(0, len(keys), MAX_KEYS_PER_MESSAGE):
            ckeys, clocal = keys[i : i + MAX_KEYS_PER_MESSAGE], local[i : i + MAX_KEYS_PER_MESSAGE]
            answer = partial(self._on_pinned, peer, ckeys, clocal, request, time.perf_counter())
            try:
                peer.session.pin(ckeys, answer)
            except ConnectionError:
                request.settle(ckeys, PEER_LOST)

    def _on_pinned(
        self,
        peer: Peer,
        keys: list[Key],
        local: list[int],
        request: Request,
        sent: float,
        future: Future[Any],
    ) -> None:
        """A pin answer (I/O thread, unlocked): read the pinned slots, the rest is missing."""
        try:
            pinned = future.result()
            error = None if hasattr(pinned, "pin_id") else f"pin refused: {pinned}"
        except Exception as exc:
            pinned, error = None, str(exc)
        with self._lock:
            peer_id = peer.slots.peer_id
            if self._closed:
                request.settle(keys, CLOSED)
            elif error is not None or self._peers.get(peer_id) is not peer:
                logger.warning("pin on %s failed: %s", peer_id, error or "peer dropped")
                request.settle(keys, PEER_LOST)
            else:
                found_keys, found_local, found_slots, gone = [], [], [], []
                for key, idx, slot in zip(keys, local, pinned.slots):
                    if slot < 0:
                        gone.append(key)
                    else:
                        found_keys.append(key)
                        found_local.append(idx)
                        found_slots.append(slot)
                request.settle(gone, MISSING)
                if gone:  # the copy of the host's index was stale
                    self._index.apply_host_changes(peer.slots, [], gone, False)  # type: ignore[arg-type]
                if found_keys:
                    op = Op("load", peer_id, peer, found_keys, found_local, found_slots, request)
                    op.pin_id = pinned.pin_id
                    op.pin_deadline = sent + pinned.ttl_s * _PIN_MARGIN
                    self._launch(op)
                else:
                    self._unpin_ids(peer, [pinned.pin_id])
            ready = self._after_submit(request, [peer_id])
        resolve(ready)

    def _unpin(self, op: Op, reason: str | None) -> str | None:
        """Release a shared read's pin; a read that finished after its pin could have expired
        may have raced an eviction and a rewrite: its keys are reported missing."""
        self._unpin_ids(op.peer, [op.pin_id])
        if reason is None and time.perf_counter() > op.pin_deadline:
            self._pins_expired += len(op.keys)
            logger.warning(
                "a read of %d blocks from %s outlived its pin: reported missing",
                len(op.keys),
                op.peer_id,
            )
            return MISSING
        return reason

    @staticmethod
    def _unpin_ids(peer: Peer, pin_ids: list[int]) -> None:
        with contextlib.suppress(ConnectionError):  # the session is ending
            peer.session.unpin(pin_ids)

    def _on_host_changes(
        self, peer_id: str, stored: list[Key], evicted: list[Key], reset: bool
    ) -> None:
        """A shared host's key set changed (I/O thread, unlocked)."""
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is not None and isinstance(peer.slots, SharedSlots):
                self._index.apply_host_changes(peer.slots, stored, evicted, reset)


class _HostChanges:
    """The ``on_change`` a shared session calls: forwards to its tier, held weakly (the tier
    owns the session; a strong reference would be a cycle keeping the tier's NIXL agent alive
    until the garbage collector runs), and marks the first snapshot."""

    def __init__(self, tier: SharedHosts, peer_id: str, synced: threading.Event) -> None:
        self._tier = weakref.ref(tier)
        self._peer_id = peer_id
        self._synced = synced

    def __call__(self, stored: list[Key], evicted: list[Key], reset: bool) -> None:
        tier = self._tier()
        if tier is not None:
            tier._on_host_changes(self._peer_id, stored, evicted, reset)
        if reset:
            self._synced.set()
