"""The tier's half of a shared remote host: granted slots, commits, recency, and the copy of
the host's key set with each key's slot and digest (the host's half is ``remote.shared_cache``).

``SharedHosts`` is a part of ``TierManager`` (its base class), kept in its own file because it is
one concept: how a tier uses a host whose index the host owns. It uses the manager's lock and
tables, and the manager's ``_launch``/``_after_submit``/``_finish``/``_register`` to submit
and settle transfers; the manager calls ``_join_shared`` from ``connect``, ``_refill`` from
``store``, ``_publish`` from its store completion and ``_touch_shared`` from ``touch`` and its
load completion.

A store writes into slots the host granted this tier ahead of time (refilled in the background
when half a batch is used) and commits its keys with their digests once the write completed; a
store with no granted slot left waits in its peer's ``awaiting`` queue (its keys are "in
flight": a second store of them joins it, a discard unpublishes them). A load reads straight
from the slot the copy of the host's index names, with no round trip to the host, and checks
the digest (the manager's load completion); recency goes to the host batched (``touch``).

Threading: methods without "(I/O thread, unlocked)" run with the manager's lock held. Answers
from the host (grants, index events) arrive on the session's I/O thread, which takes the lock
itself; a request's answer callback is attached before the request is sent, so it never runs
on the caller's thread (where the lock is held and not reentrant).

Failure model: a grant that does not come (the host refused, or timed out) leaves the stores
waiting for it to fail with "capacity" only when nothing this tier does could free its share.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from torch_kv_tier.index import BlockIndex, SharedSlots
from torch_kv_tier.keys import Key
from torch_kv_tier.records import Op, Peer, Request, resolve
from torch_kv_tier.results import CAPACITY
from torch_kv_tier.transport.base import DataTransport

logger = logging.getLogger(__name__)

MAX_GRANT = 4096  # the most slots one grant request asks a shared host for


class SharedHosts:
    """Shared-host behaviour of ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    grant_batch: int
    transport: DataTransport
    _lock: threading.Lock
    _closed: bool
    _index: BlockIndex
    _peers: dict[str, Peer]
    _storing: dict[Key, Op]

    if TYPE_CHECKING:  # implemented by TierManager

        def _check_open(self) -> None: ...
        def _launch(self, op: Op) -> None: ...
        def _finish(self, op: Op, reason: str | None) -> None: ...
        def _after_submit(
            self, request: Request | None, peer_ids: Iterable[str]
        ) -> list[Request]: ...
        def _register(
            self, peer_id: str, meta: bytes, base: int, num_blocks: int, block_len: int
        ) -> None: ...
        def remove_peer(self, peer_id: str) -> None: ...

    def _join_shared(self, session: Any, timeout_s: float) -> None:
        """Register a shared host: its NIXL region (outside the lock), its first grant (in the
        background), then its key set (awaited)."""
        peer_id = session.peer_id
        self._register(
            peer_id,
            session.agent_metadata,
            session.base_addr,
            session.num_blocks,
            session.block_len,
        )
        with self._lock:
            self._check_open()
            peer = self._peers[peer_id] = Peer(
                self._index.add_shared_peer(peer_id, session.num_blocks)
            )
            peer.session = session
            self._refill(peer)
        try:
            synced = threading.Event()
            session.follow(_HostChanges(self, peer_id, synced))
            if not synced.wait(timeout_s):
                raise TimeoutError(f"{peer_id} did not send its index within {timeout_s} s")
        except BaseException:
            self.remove_peer(peer_id)
            raise

    def _refill(self, peer: Peer) -> None:
        """Ask the host for more slots when fewer than half a batch are left, or stores wait
        for slots; the answer lands in ``_on_granted``, on the session's I/O thread. After a
        grant that came short (the host caps what one session holds uncommitted), only a
        commit (which makes room in this tier's share) or a waiting store asks again."""
        slots = peer.slots
        assert isinstance(slots, SharedSlots)
        need = sum(len(op.keys) for op in peer.awaiting)
        if slots.refilling or (
            not need and (slots.capped or len(slots.grants) >= self.grant_batch // 2)
        ):
            return
        want = min(max(self.grant_batch, 2 * need), MAX_GRANT)
        try:
            peer.session.grant(want, partial(self._on_granted, peer, slots.commits, want))
        except ConnectionError:
            return  # the session is ending; its loss drops the peer
        slots.refilling = True

    def _on_granted(self, peer: Peer, commits: int, want: int, future: Future[Any]) -> None:
        """A grant answer (I/O thread, unlocked): stores waiting for slots go out. With no
        slot granted, none of this tier's writes to the host in flight and no commit sent since
        the request (either would make room in its share), they fail with "capacity"."""
        granted: list[int] = []
        failed = True  # no answer, or an ``Error`` (the host no longer knows the session)
        try:
            answer = future.result()
        except Exception as exc:
            logger.warning("grant from %s failed: %s", peer.slots.peer_id, exc)
        else:
            failed = not hasattr(answer, "slots")
            if failed:
                logger.warning("grant from %s refused: %s", peer.slots.peer_id, answer)
            else:
                granted = answer.slots
        if failed and peer.session.lost is not None:
            with self._lock:  # its loss drops the peer: the waiting stores fail "peer lost"
                peer.slots.refilling = False  # type: ignore[union-attr]
            return
        with self._lock:
            slots = peer.slots
            assert isinstance(slots, SharedSlots)
            slots.refilling = False
            if self._closed or self._peers.get(slots.peer_id) is not peer:
                return
            slots.grants.extend(granted)
            slots.capped = len(granted) < want and slots.commits == commits
            self._launch_awaiting(peer)
            busy = peer.inflight or peer.queue or slots.commits != commits
            if peer.awaiting and not granted and not busy:
                self._fail_awaiting(peer, CAPACITY)
            if not slots.capped:  # a capped tier asks again after its next commit
                self._refill(peer)
            ready = self._after_submit(None, [slots.peer_id])
        resolve(ready)

    def _launch_awaiting(self, peer: Peer) -> None:
        """Send waiting stores into the slots granted so far (in order, split as needed)."""
        slots = peer.slots
        while peer.awaiting and slots.grants:  # type: ignore[union-attr]
            op = peer.awaiting.popleft()
            op.remote = self._index.reserve(slots, len(op.keys))
            if len(op.remote) < len(op.keys):
                rest = op.split(len(op.remote))
                self._storing.update(dict.fromkeys(rest.keys, rest))
                peer.awaiting.appendleft(rest)
            self._launch(op)

    def _fail_awaiting(self, peer: Peer, reason: str) -> None:
        while peer.awaiting:
            self._finish(peer.awaiting.popleft(), reason)

    def _publish(self, peer: Peer, keys: list[Key], slots: list[int], digests: list[int]) -> None:
        """Make written ``keys`` visible; a shared host learns them with a commit, which
        returns their slots from this tier's share of grants, so stores waiting for slots may
        ask again."""
        self._index.publish(peer.slots, keys, slots, digests)
        if not keys or not isinstance(peer.slots, SharedSlots):
            return
        peer.slots.commits += 1
        peer.slots.capped = False
        with contextlib.suppress(ConnectionError):  # the session is ending
            peer.session.commit(keys, slots, digests)
        if peer.awaiting:
            self._refill(peer)

    def _touch_shared(self, groups: dict[SharedSlots, list[Key]]) -> None:
        """Report recency to shared hosts (batched by their sessions)."""
        for slots, keys in groups.items():
            with contextlib.suppress(ConnectionError):  # the session is ending
                self._peers[slots.peer_id].session.touch(keys)

    def _on_host_changes(
        self,
        peer_id: str,
        stored: list[Key],
        slots: list[int],
        digests: list[int],
        evicted: list[Key],
        reset: bool,
    ) -> None:
        """A shared host's key set changed (I/O thread, unlocked)."""
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is not None and isinstance(peer.slots, SharedSlots):
                self._index.apply_host_changes(peer.slots, stored, slots, digests, evicted, reset)


class _HostChanges:
    """The ``on_change`` a shared session calls: forwards to its tier, held weakly (the tier
    owns the session; a strong reference would be a cycle keeping the tier's NIXL agent alive
    until the garbage collector runs), and marks the first snapshot."""

    def __init__(self, tier: SharedHosts, peer_id: str, synced: threading.Event) -> None:
        self._tier = weakref.ref(tier)
        self._peer_id = peer_id
        self._synced = synced

    def __call__(
        self,
        stored: list[Key],
        slots: list[int],
        digests: list[int],
        evicted: list[Key],
        reset: bool,
    ) -> None:
        tier = self._tier()
        if tier is not None:
            tier._on_host_changes(self._peer_id, stored, slots, digests, evicted, reset)
        if reset:
            self._synced.set()


__all__ = ["MAX_GRANT", "SharedHosts"]
