"""``TierManager``: logical KV block keys kept on remote peers, moved by a background thread."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.keys import Key, check_keys, home_peer
from torch_kv_tier.results import (
    CAPACITY,
    CLOSED,
    MISSING,
    NO_PEERS,
    PEER_LOST,
    TRANSFER_FAILED,
    PeerStats,
    TierEvent,
    TierStats,
    TransferResult,
)
from torch_kv_tier.slots import SlotPool
from torch_kv_tier.transport.base import DataTransport, PollResult, block_indices

logger = logging.getLogger(__name__)

_MAX_EVENTS = 100_000
_LATENCY_WINDOW = 4096
_SPIN_S = 0.002  # how long the poller polls back to back after activity


class _Request:
    """One ``store``/``load`` call: its future and the keys it still waits for."""

    def __init__(self, keys: list[Key]) -> None:
        self.future: Future[TransferResult] = Future()
        self.keys = keys
        self.waiting = set(keys)
        self.failed: dict[Key, str] = {}
        self.nbytes = 0
        self.started = time.perf_counter()

    def settle(self, key: Key, reason: str | None) -> None:
        self.waiting.discard(key)
        if reason is not None:
            self.failed[key] = reason

    def result(self) -> TransferResult:
        ok_keys = [k for k in self.keys if k not in self.failed]
        return TransferResult(
            ok=not self.failed,
            keys=ok_keys,
            failed=dict(self.failed),
            nbytes=self.nbytes,
            seconds=time.perf_counter() - self.started,
        )


@dataclass
class _Peer:
    pool: SlotPool
    stored: OrderedDict[Key, int] = field(default_factory=OrderedDict)  # LRU order, oldest first
    pins: Counter[int] = field(default_factory=Counter)  # slot -> loads in flight
    doomed: set[int] = field(default_factory=set)  # discarded while pinned: free on unpin
    inflight: int = 0  # this peer's ops submitted to the transport
    queue: deque[_Op] = field(default_factory=deque)  # this peer's ops waiting for capacity
    session: Any = None  # RemoteSession when the peer came from connect()


@dataclass
class _Op:
    """One transfer to one peer, carrying keys of its owner request and of requests that joined."""

    kind: Literal["store", "load"]
    peer_id: str
    peer: _Peer  # the registration this op was made for (a re-added peer_id is another one)
    keys: list[Key]
    local: list[int]
    remote: list[int]
    owner: _Request
    joined: list[_Request] = field(default_factory=list)
    discarded: set[Key] = field(default_factory=set)
    submitted: float = 0.0


class TierManager:
    """Keeps KV blocks under logical keys on remote peers and brings them back.

    ``store`` and ``load`` never block: they return futures, resolved on the calling thread when
    the transfer finished during submission, else by a background thread draining
    ``transport.poll()``. Each key has one remote home chosen by rendezvous hashing
    over the peers; a key is visible to ``lookup``/``contains``/``load`` only once its write
    completed. A full peer evicts its least recently used keys (never one being loaded). At most
    ``max_inflight`` transfers per peer are submitted at once; the rest wait in that peer's
    queue, in order, so a stalled peer holds back no other.

    Threading: any thread may call any method. ``_lock`` (with its condition ``_cond``) guards
    every table: peers, index, in-flight and queued transfers, events and counters. Futures are
    resolved, and their callbacks run, on the calling or background thread *outside* the lock,
    so a callback may call back into the manager. A callback that raises is logged by
    ``concurrent.futures`` and stops nothing.

    Failure policy: a transfer the transport reports as failed fails its keys, and its peer is
    treated as lost (removed, its keys dropped): a cache entry that cannot be trusted is cheaper
    to recompute than to serve.
    """

    def __init__(
        self,
        arena: BlockArena,
        transport: DataTransport,
        *,
        max_inflight: int = 64,
        max_poll_interval_s: float = 500e-6,
    ) -> None:
        if (arena.num_blocks, arena.block_len) != (transport.num_blocks, transport.block_len):
            raise ValueError(
                f"arena {arena.num_blocks} x {arena.block_len} does not match the transport's "
                f"region {transport.num_blocks} x {transport.block_len}: build the transport "
                "over arena.tensor"
            )
        if max_inflight <= 0:
            raise ValueError(f"max_inflight must be > 0, got {max_inflight}")
        self.arena = arena
        self.transport = transport
        self.max_inflight = max_inflight
        self._max_poll_interval_s = max_poll_interval_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._peers: dict[str, _Peer] = {}
        self._index: dict[Key, tuple[str, int]] = {}  # key -> (peer_id, remote slot)
        self._storing: dict[Key, _Op] = {}  # key -> its store in flight or queued
        self._ops: dict[int, _Op] = {}  # transfer id -> op
        self._ready: list[_Request] = []  # settled requests whose futures are not yet resolved
        self._events: deque[tuple[str, Key, str]] = deque(maxlen=_MAX_EVENTS)
        self._counters: Counter[str] = Counter()
        self._latencies_us: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._closed = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tkvt-poller", daemon=True)
        self._thread.start()

    @classmethod
    def create(
        cls,
        num_blocks: int,
        block_len: int,
        *,
        device: str = "cpu",
        config_fields: dict[str, Any] | None = None,
        name: str = "tier",
        max_inflight: int = 64,
    ) -> TierManager:
        """A tier over a fresh ``BlockArena`` registered with a ``NixlTransport``."""
        from torch_kv_tier.transport.nixl import NixlTransport

        arena = BlockArena(num_blocks, block_len, device=device)
        transport = NixlTransport(name, arena.tensor, config_fields=config_fields)
        return cls(arena, transport, max_inflight=max_inflight)

    # -- peers --------------------------------------------------------------------------------

    def add_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
        *,
        slots: range | None = None,
    ) -> None:
        """Register a remote region; the tier may use ``slots`` of it (default: all).

        Re-adding a known ``peer_id`` drops the old registration and its keys first.
        """
        slots = range(num_blocks) if slots is None else slots
        if block_len != self.transport.block_len:
            raise ValueError(
                f"peer block_len {block_len} != local block_len {self.transport.block_len}"
            )
        if slots.step != 1 or not slots or slots.start < 0 or slots.stop > num_blocks:
            raise ValueError(
                f"slots {slots!r} must be a non-empty step-1 range in [0, {num_blocks})"
            )
        pool = SlotPool(slots)
        with self._lock:
            self._check_open()
            if peer_id in self._peers:
                self._drop_peer(peer_id)
            self.transport.add_remote_peer(
                peer_id, agent_metadata, base_addr, num_blocks, block_len
            )
            self._peers[peer_id] = _Peer(pool)
        self._flush()

    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer: its in-flight futures fail with "peer lost", its keys are dropped.

        Raises ``KeyError`` for an unknown peer.
        """
        with self._lock:
            self._check_open()
            if peer_id not in self._peers:
                raise KeyError(f"unknown peer {peer_id!r}; known: {sorted(self._peers)}")
            session = self._drop_peer(peer_id)
        self._flush()
        if session is not None:
            session.close()

    def connect(
        self,
        address: str,
        *,
        token: str | None = None,
        slots: int | None = None,
        timeout_s: float = 10.0,
        heartbeat_timeout_s: float = 10.0,
    ) -> str:
        """Lease slots on a ``torch-kv-tier serve`` host at ``HOST:PORT``; return its peer id.

        Raises ``HandshakeRejected`` with the server's reason, ``TimeoutError`` when nothing
        answers within ``timeout_s``. When the server stops answering heartbeats for
        ``heartbeat_timeout_s`` the peer is removed as lost.
        """
        from torch_kv_tier.remote.client import RemoteSession
        from torch_kv_tier.remote.protocol import Region

        t = self.transport
        session = RemoteSession.open(
            address,
            agent_metadata=t.get_agent_metadata(),
            region=Region(t.base_addr, t.num_blocks, t.block_len, t.mem_type),
            config_fingerprint=t.config_fingerprint,
            token=token,
            slots=slots,
            on_lost=self._on_session_lost,
            timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        try:
            self.add_peer(
                session.peer_id,
                session.agent_metadata,
                session.base_addr,
                session.num_blocks,
                session.block_len,
                slots=session.lease,
            )
            with self._lock:
                self._peers[session.peer_id].session = session
        except BaseException:
            session.close()
            raise
        return str(session.peer_id)

    def disconnect(self, peer_id: str) -> None:
        """Return a connected peer's lease and forget it (as ``remove_peer``)."""
        self.remove_peer(peer_id)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    # -- data ---------------------------------------------------------------------------------

    def store(self, keys: Sequence[Key], local_idxs: Sequence[int]) -> Future[TransferResult]:
        """Copy arena blocks ``local_idxs`` to remote slots under ``keys``. Never blocks.

        Already-stored keys send nothing and succeed; keys whose store is in flight join it.
        Raises ``TypeError``/``ValueError``/``IndexError`` for bad input, before any transfer.
        """
        keys = check_keys(keys)
        local = self._check_local(local_idxs, len(keys), unique=False)
        request = _Request(keys)
        with self._lock:
            self._check_open()
            batches: dict[str, list[tuple[Key, int]]] = {}
            for key, idx in zip(keys, local):
                if key in self._index:
                    peer_id, _ = self._index[key]
                    self._peers[peer_id].stored.move_to_end(key)
                    request.settle(key, None)
                elif key in self._storing:
                    self._storing[key].joined.append(request)
                else:
                    home = home_peer(key, self._peers)
                    if home is None:
                        request.settle(key, NO_PEERS)
                    else:
                        batches.setdefault(home, []).append((key, idx))
            for peer_id, batch in batches.items():
                slots = self._reserve(peer_id, len(batch))
                for key, _ in batch[len(slots) :]:
                    request.settle(key, CAPACITY)
                batch = batch[: len(slots)]
                if batch:
                    op = _Op(
                        "store",
                        peer_id,
                        self._peers[peer_id],
                        [k for k, _ in batch],
                        [i for _, i in batch],
                        slots,
                        request,
                    )
                    for key in op.keys:
                        self._storing[key] = op
                    self._launch(op)
            self._reap_inline(batches)
            self._settle_if_done(request)
        self._flush()
        return request.future

    def load(self, keys: Sequence[Key], local_idxs: Sequence[int]) -> Future[TransferResult]:
        """Bring the blocks stored under ``keys`` into arena blocks ``local_idxs``. Never blocks.

        A key that is not stored fails with "missing"; the others still load. The remote slots
        being read are pinned (never evicted or reused) until the read completes.
        """
        keys = check_keys(keys)
        local = self._check_local(local_idxs, len(keys), unique=True)
        request = _Request(keys)
        with self._lock:
            self._check_open()
            batches: dict[str, list[tuple[Key, int, int]]] = {}
            for key, idx in zip(keys, local):
                entry = self._index.get(key)
                if entry is None:
                    request.settle(key, MISSING)
                    continue
                peer_id, slot = entry
                peer = self._peers[peer_id]
                peer.stored.move_to_end(key)
                peer.pins[slot] += 1
                batches.setdefault(peer_id, []).append((key, idx, slot))
            for peer_id, batch in batches.items():
                keys_, local_, remote = (list(x) for x in zip(*batch))
                op = _Op("load", peer_id, self._peers[peer_id], keys_, local_, remote, request)
                self._launch(op)
            self._reap_inline(batches)
            self._settle_if_done(request)
        self._flush()
        return request.future

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored (the prefix a scheduler can load)."""
        with self._lock:
            for n, key in enumerate(keys):
                if key not in self._index:
                    return n
            return len(keys)

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._index

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark stored ``keys`` as recently used, so a full peer evicts them last (unknown keys
        are ignored)."""
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is not None:
                    self._peers[entry[0]].stored.move_to_end(key)

    def discard(self, keys: Sequence[Key]) -> None:
        """Forget ``keys`` (unknown ones are ignored); a store in flight will not publish them."""
        with self._lock:
            for key in keys:
                op = self._storing.pop(key, None)  # a later store of key starts afresh
                if op is not None:
                    op.discarded.add(key)
                entry = self._index.pop(key, None)
                if entry is None:
                    continue
                peer_id, slot = entry
                peer = self._peers[peer_id]
                del peer.stored[key]
                if peer.pins[slot]:
                    peer.doomed.add(slot)
                else:
                    peer.pool.free([slot])
                self._event("discarded", key, peer_id)

    # -- observation --------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            lat = np.asarray(self._latencies_us) if self._latencies_us else np.zeros(1)
            c = self._counters
            return TierStats(
                blocks_stored=c["blocks_stored"],
                bytes_stored=c["blocks_stored"] * self.transport.block_len,
                blocks_loaded=c["blocks_loaded"],
                bytes_loaded=c["blocks_loaded"] * self.transport.block_len,
                transfers_done=c["transfers_done"],
                transfers_failed=c["transfers_failed"],
                evictions=c["evictions"],
                inflight=len(self._ops),
                queued=sum(len(p.queue) for p in self._peers.values()),
                keys=len(self._index),
                latency_p50_us=float(np.percentile(lat, 50)),
                latency_p99_us=float(np.percentile(lat, 99)),
                events_dropped=c["events_dropped"],
                peers={
                    pid: PeerStats(len(p.pool), len(p.pool) - p.pool.num_free, len(p.stored))
                    for pid, p in self._peers.items()
                },
            )

    def take_events(self) -> list[TierEvent]:
        """Index changes since the last call, oldest first (at most the newest 100,000)."""
        with self._lock:
            events = [TierEvent(*event) for event in self._events]  # type: ignore[arg-type]
            self._events.clear()
            return events

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting work, wait up to ``timeout`` s for transfers in flight, cancel the rest
        (their keys fail with "closed"), then close the sessions and the transport. Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in self._peers.values():
                while peer.queue:
                    self._finish(peer.queue.popleft(), CLOSED)
            deadline = time.monotonic() + timeout
            while self._ops and time.monotonic() < deadline:
                self._cond.wait(timeout=deadline - time.monotonic())
            leftover = list(self._ops)
            if leftover:
                logger.warning("closing with %d transfers in flight: cancelling", len(leftover))
                self.transport.cancel(leftover)
                for tid in leftover:
                    self._finish(self._ops.pop(tid), CLOSED)
            self._stopping = True
            self._cond.notify_all()
            sessions = [p.session for p in self._peers.values() if p.session is not None]
        self._flush()
        if threading.current_thread() is not self._thread:  # close() from a done-callback
            self._thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        # Disconnects run side by side and get what is left of the timeout (at least 0.1 s);
        # a host that does not answer reclaims the lease itself after its lease timeout.
        closers = [threading.Thread(target=s.close, daemon=True) for s in sessions]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(timeout=max(deadline - time.monotonic(), 0.1))
        self.transport.close()

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- background thread --------------------------------------------------------------------

    def _run(self) -> None:
        """Drain ``transport.poll()`` while transfers are in flight; sleep on ``_cond`` when idle.

        Polling is what progresses an initiator's transfers (UCX moves a large transfer in
        fragments, each needing a progress call), so for ``_SPIN_S`` after waking up or after
        its last completion the thread polls back to back, yielding the GIL between polls.
        After that it sleeps 50 us, doubling up to ``max_poll_interval_s``: a long quiet
        transfer, or transfers that submitting threads complete themselves (``_reap_inline``),
        do not keep a core busy.
        """
        delay = 0.0
        last_activity = time.perf_counter()
        while True:
            with self._cond:
                if not self._ops:
                    delay, last_activity = 0.0, time.perf_counter()
                while not self._ops and not self._stopping:
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    return
            try:
                result = self.transport.poll()
            except Exception:
                logger.exception("transport.poll failed; retrying")
                time.sleep(0.01)
                continue
            if result.done or result.failed:
                try:
                    with self._cond:
                        self._complete(result)
                        self._cond.notify_all()
                    self._flush()
                except Exception:  # a bug here must not leave every later future hanging
                    logger.exception("completing transfers failed")
                delay, last_activity = 0.0, time.perf_counter()
            elif time.perf_counter() - last_activity < _SPIN_S:
                time.sleep(0)
            else:
                time.sleep(delay)
                delay = min(max(delay * 2, 50e-6), self._max_poll_interval_s)

    # -- internals; callers hold self._lock unless noted --------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TierManager is closed")

    def _check_local(self, idxs: Sequence[int], n: int, *, unique: bool) -> list[int]:
        if len(idxs) != n:
            raise ValueError(f"{n} keys need {n} local block indices, got {len(idxs)}")
        local = block_indices(idxs, self.arena.num_blocks, "local")
        if unique and len(set(local)) != n:
            raise ValueError(
                "a local block index repeats: each destination block may be loaded once"
            )
        return local

    def _reserve(self, peer_id: str, n: int) -> list[int]:
        """Up to ``n`` free slots of the peer, evicting least recently used unpinned keys."""
        peer = self._peers[peer_id]
        need = n - peer.pool.num_free
        if need > 0:
            victims: list[Key] = []
            for key, slot in peer.stored.items():  # oldest first; stops at the first `need`
                if len(victims) == need:
                    break
                if not peer.pins[slot]:
                    victims.append(key)
            for key in victims:
                del self._index[key]
                self._event("evicted", key, peer_id)
            peer.pool.free([peer.stored.pop(key) for key in victims])
            self._counters["evictions"] += len(victims)
        return peer.pool.allocate(min(n, peer.pool.num_free))

    def _launch(self, op: _Op) -> None:
        if op.peer.inflight >= self.max_inflight:
            op.peer.queue.append(op)
        else:
            self._submit(op)

    def _reap_inline(self, peer_ids: Iterable[str]) -> None:
        """Poll the peers just submitted to, on the calling thread.

        Over shared memory a transfer often finishes inside ``transfer()``; completing it here
        spares two thread switches before its future resolves. Cost: one state check per
        transfer in flight to those peers (at most ``max_inflight`` each).
        """
        for peer_id in peer_ids:
            if peer_id not in self._peers:
                continue
            try:
                result = self.transport.poll(peer_id)
            except Exception:
                logger.exception("transport.poll(%s) failed; the poller will retry", peer_id)
                return
            if result.done or result.failed:
                self._complete(result)
                self._cond.notify_all()

    def _live_peer(self, op: _Op) -> _Peer | None:
        """The op's peer if it is still registered (not removed, not replaced)."""
        return op.peer if self._peers.get(op.peer_id) is op.peer else None

    def _submit(self, op: _Op) -> None:
        if self._live_peer(op) is None:
            self._finish(op, PEER_LOST)
            return
        send = self.transport.write_blocks if op.kind == "store" else self.transport.read_blocks
        try:
            tid = send(op.peer_id, op.local, op.remote)
        except Exception:
            logger.exception("submitting a %s to %s failed", op.kind, op.peer_id)
            tid = None
        if tid is None:
            self._finish(op, TRANSFER_FAILED)
            self._lose_peer(op.peer_id, "refused a transfer")
            return
        op.submitted = time.perf_counter()
        op.peer.inflight += 1
        self._ops[tid] = op
        self._cond.notify_all()

    def _complete(self, result: PollResult) -> None:
        lost: set[str] = set()
        for tid, ok in [(t, True) for t in result.done] + [(t, False) for t in result.failed]:
            op = self._ops.pop(tid, None)
            if op is None:
                continue
            op.peer.inflight -= 1
            self._latencies_us.append((time.perf_counter() - op.submitted) * 1e6)
            if ok:
                self._counters["transfers_done"] += 1
                self._finish(op, None)
            else:
                self._counters["transfers_failed"] += 1
                alive = self._live_peer(op) is not None
                self._finish(op, TRANSFER_FAILED if alive else PEER_LOST)
                if alive:
                    lost.add(op.peer_id)
        for peer_id in lost:
            self._lose_peer(peer_id, "failed a transfer")
        for peer in self._peers.values():
            while peer.queue and peer.inflight < self.max_inflight:
                self._submit(peer.queue.popleft())

    def _finish(self, op: _Op, reason: str | None) -> None:
        """Apply a finished (or abandoned) op to the index and settle its requests' keys."""
        peer = self._live_peer(op)
        if op.kind == "store":
            unused: list[int] = []
            for key, slot in zip(op.keys, op.remote):
                if self._storing.get(key) is op:
                    del self._storing[key]
                if reason is None and key not in op.discarded:
                    if peer is not None:
                        self._index[key] = (op.peer_id, slot)
                        peer.stored[key] = slot
                        self._event("stored", key, op.peer_id)
                else:
                    unused.append(slot)
            if peer is not None:
                peer.pool.free(unused)
            if reason is None:
                self._counters["blocks_stored"] += len(op.keys)
        else:
            if peer is not None:
                for slot in op.remote:
                    self._unpin(peer, slot)
            if reason is None:
                self._counters["blocks_loaded"] += len(op.keys)
        if reason is None:
            op.owner.nbytes += len(op.keys) * self.transport.block_len
            if peer is not None and peer.session is not None:
                moved = len(op.keys) * self.transport.block_len
                peer.session.report_usage(
                    written=moved if op.kind == "store" else 0,
                    read=moved if op.kind == "load" else 0,
                    slots_used=len(peer.pool) - peer.pool.num_free,
                )
        for request in [op.owner, *op.joined]:
            for key in op.keys:
                if key in request.waiting:
                    request.settle(key, reason)
            self._settle_if_done(request)

    @staticmethod
    def _unpin(peer: _Peer, slot: int) -> None:
        peer.pins[slot] -= 1
        if not peer.pins[slot]:
            del peer.pins[slot]
            if slot in peer.doomed:
                peer.doomed.discard(slot)
                peer.pool.free([slot])

    def _settle_if_done(self, request: _Request) -> None:
        if not request.waiting and not request.future.done() and request not in self._ready:
            self._ready.append(request)

    def _event(self, kind: str, key: Key, peer_id: str) -> None:
        # A plain tuple of atoms: the garbage collector stops tracking it, which matters
        # when many thousands of events wait for take_events().
        if len(self._events) == self._events.maxlen:
            self._counters["events_dropped"] += 1
        self._events.append((kind, key, peer_id))

    def _drop_peer(self, peer_id: str) -> Any:
        """Forget a peer and its keys; fail its queued ops. Returns its session (to close)."""
        peer = self._peers.pop(peer_id)
        for key in peer.stored:
            del self._index[key]
            self._event("lost", key, peer_id)
        while peer.queue:
            self._finish(peer.queue.popleft(), PEER_LOST)
        try:
            self.transport.remove_remote_peer(peer_id)
        except Exception:
            logger.exception("removing peer %s from the transport failed", peer_id)
        return peer.session

    def _lose_peer(self, peer_id: str, why: str) -> None:
        """Drop a failed peer and its keys (see the failure policy in the class doc)."""
        if peer_id not in self._peers:
            return
        logger.warning("%s %s: dropping it and its keys", peer_id, why)
        session = self._drop_peer(peer_id)
        if session is not None:  # closing waits for the server: not under the lock
            threading.Thread(target=session.close, daemon=True).start()

    def _on_session_lost(self, peer_id: str) -> None:
        """Heartbeat thread: the server stopped answering."""
        with self._lock:
            if self._closed:
                return
            self._lose_peer(peer_id, "stopped answering heartbeats")
        self._flush()

    def _flush(self) -> None:
        """Resolve settled futures; called without the lock held."""
        with self._lock:
            ready, self._ready = self._ready, []
        for request in ready:
            request.future.set_result(request.result())


__all__ = ["TierEvent", "TierManager", "TierStats", "TransferResult"]
