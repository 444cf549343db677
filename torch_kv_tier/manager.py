"""``TierManager``: logical KV block keys kept on remote peers, moved by NIXL transfers.

Orchestration only: the index of what is stored where (placement, slot pool, LRU, pins) lives in
``torch_kv_tier.index``, the per-call, per-transfer and per-peer records in
``torch_kv_tier.records``; this module turns calls into transfers, tracks them until the transport
reports them, resolves futures and handles peers coming and going.

Threading: any thread may call any method. ``_lock`` (with its condition ``_cond``) guards every
table. A call submits its transfers and polls the peers it submitted to on the calling thread:
a transfer NIXL finished during submission completes there, and the background poller is not
woken. The poller runs only while transfers are in flight, and sleeps on ``_cond`` otherwise.
Futures are resolved, and their callbacks run, *outside* the lock (on the calling thread or the
poller), so a callback may call back into the manager.

Failure model: a transfer the transport reports failed fails its keys, and its peer is dropped
with its keys (a cache entry that cannot be trusted is cheaper to recompute than to serve); so
does a peer the transport reports faulted (``PollResult.peer_fault``/``faulted_peers()``). The
futures of a dropped peer's transfers resolve at once ("peer lost"), but a write that the
transport still holds in flight may land later: its remote slots stay fenced (out of every pool
of that peer id) until the transport reports it, or until the peer's lease is gone.

Shared hosts (``connect`` without ``private=True``): the host owns the index of its pool. A
store writes into slots the host granted this tier ahead of time (refilled in the background)
and commits its keys to the host once the write completed; the host then tells every tier of
the namespace, whose copy of the host's key set answers ``lookup`` with no network round trip.
A load first pins its keys on the host (one control round trip, answered on the session's I/O
thread, where the read is then submitted); a key the host no longer has, or a read that
finished later than its pin's TTL allows, is reported "missing", never as wrong bytes. That
half of the manager lives in ``torch_kv_tier.shared_hosts`` (its base class).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.index import BlockIndex, SharedSlots, drain
from torch_kv_tier.keys import Key, check_keys
from torch_kv_tier.records import Op, Peer, Request, resolve
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
from torch_kv_tier.shared_hosts import MAX_GRANT, SharedHosts
from torch_kv_tier.transport.base import DataTransport, PollResult, block_indices

logger = logging.getLogger(__name__)

_LATENCY_WINDOW = 4096
_SPIN_S = 0.002  # how long the poller polls back to back after activity
_USAGE_PERIOD_S = 0.25  # bytes moved reach a peer's session at most this often (heartbeat: 1 s)


class TierManager(SharedHosts):
    """Keeps KV blocks under logical keys on remote peers and brings them back.

    ``store`` and ``load`` never block: they return futures, resolved on the calling thread when
    the transfer finished during submission, else by a background thread draining
    ``transport.poll()``. Each key has one remote home chosen by rendezvous hashing over the
    peers; a key is visible to ``lookup``/``contains``/``load`` only once its write completed.
    A full peer evicts its least recently used keys (never one being loaded). At most
    ``max_inflight`` transfers per peer are submitted at once; the rest wait in that peer's
    queue, in order, so a stalled peer holds back no other. Index events (``take_events``) are
    recorded only when the tier is built with ``events=True``.

    Threading and failures: see the module docstring.
    """

    def __init__(
        self,
        arena: BlockArena,
        transport: DataTransport,
        *,
        max_inflight: int = 64,
        max_poll_interval_s: float = 500e-6,
        events: bool = False,
        grant_batch: int = 512,
    ) -> None:
        if (arena.num_blocks, arena.block_len) != (transport.num_blocks, transport.block_len):
            raise ValueError(
                f"arena {arena.num_blocks} x {arena.block_len} does not match the transport's "
                f"region {transport.num_blocks} x {transport.block_len}: build the transport "
                "over arena.tensor"
            )
        if max_inflight <= 0:
            raise ValueError(f"max_inflight must be > 0, got {max_inflight}")
        if not 0 < grant_batch <= MAX_GRANT:
            raise ValueError(f"grant_batch must be in [1, {MAX_GRANT}], got {grant_batch}")
        self.grant_batch = grant_batch
        self.arena = arena
        self.transport = transport
        self._num_local, self._block_len = transport.num_blocks, transport.block_len
        self.max_inflight = max_inflight
        self._max_poll_interval_s = max_poll_interval_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index = BlockIndex(events=events)
        self._peers: dict[str, Peer] = {}
        self._storing: dict[Key, Op] = {}  # key -> its store in flight or queued
        self._ops: dict[int, Op] = {}  # transfer id -> op the transport holds
        self._ready: list[Request] = []  # settled requests whose futures are not yet resolved
        self._blocks_stored = self._blocks_loaded = 0
        self._transfers_done = self._transfers_failed = 0
        self._pins_expired = 0
        self._usage_due = 0.0  # perf_counter time of the next usage report to the sessions
        self._latencies_us: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._poller_idle = False
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
        events: bool = False,
        grant_batch: int = 512,
    ) -> TierManager:
        """A tier over a fresh ``BlockArena`` registered with a ``NixlTransport``.

        A tier only initiates transfers, and its poller progresses them, so its transport runs
        without NIXL's progress thread (``passive_progress=False``), which would compete with
        the poller for the same UCX worker.
        """
        from torch_kv_tier.transport.nixl import NixlTransport

        arena = BlockArena(num_blocks, block_len, device=device)
        transport = NixlTransport(
            name, arena.tensor, config_fields=config_fields, passive_progress=False
        )
        return cls(
            arena, transport, max_inflight=max_inflight, events=events, grant_batch=grant_batch
        )

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

        Re-adding a known ``peer_id`` drops the old registration and its keys first; slots that
        a write of the old registration may still land on are withheld until it resolves.
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
        with self._lock:
            self._check_open()
            if peer_id in self._peers:
                self._drop_peer(peer_id)
            self.transport.add_remote_peer(
                peer_id, agent_metadata, base_addr, num_blocks, block_len
            )
            self._peers[peer_id] = Peer(self._index.add_peer(peer_id, slots))
        self._flush()

    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer: its pending futures fail with "peer lost", its keys are dropped.

        Raises ``KeyError`` for an unknown peer.
        """
        with self._lock:
            self._check_open()
            if peer_id not in self._peers:
                raise KeyError(f"unknown peer {peer_id!r}; known: {sorted(self._peers)}")
            session = self._drop_peer(peer_id)
        self._flush()
        if session is not None:
            self._close_session(peer_id, session)

    def connect(
        self,
        address: str,
        *,
        token: str | None = None,
        private: bool = False,
        slots: int | None = None,
        timeout_s: float = 10.0,
        heartbeat_timeout_s: float = 10.0,
    ) -> str:
        """Join the shared pool of a ``torch-kv-tier serve`` host at ``HOST:PORT`` (or, with
        ``private=True``, lease up to ``slots`` of its slots for this tier alone); return its
        peer id.

        Shared: every tier with the same config fingerprint sees the keys the others stored
        (the host's keys are known here before this returns). Raises ``HandshakeRejected`` with
        the server's reason, ``TimeoutError`` when nothing answers within ``timeout_s``. When
        the server stops answering heartbeats for ``heartbeat_timeout_s`` the peer is removed
        as lost.
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
            private=private,
        )
        if session.shared:
            self._join_shared(session, timeout_s)
            return str(session.peer_id)
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
        request = Request(keys)
        with self._lock:
            self._check_open()
            index, storing = self._index, self._storing
            if index.where.keys().isdisjoint(keys) and storing.keys().isdisjoint(keys):
                new_keys, new_local = keys, local
            else:
                new_keys, new_local, stored = [], [], []
                for key, idx in zip(keys, local):
                    if key in index.where:
                        stored.append(key)
                    elif key in storing:
                        storing[key].joined.setdefault(request, []).append(key)
                    else:
                        new_keys.append(key)
                        new_local.append(idx)
                self._touch_shared(index.touch(stored))
                request.settle(stored, None)
            groups = index.place(new_keys, new_local) if new_keys else {}
            launched: list[Op] = []
            if new_keys and not groups:
                request.settle(new_keys, NO_PEERS)
            for peer_id, (gkeys, glocal) in groups.items():
                peer = self._peers[peer_id]
                slots = index.reserve(peer.slots, len(gkeys))
                if len(slots) < len(gkeys):
                    rest = (gkeys[len(slots) :], glocal[len(slots) :])
                    del gkeys[len(slots) :], glocal[len(slots) :]
                    if isinstance(peer.slots, SharedSlots):  # waits for the host's next grant
                        peer.awaiting.append((request, *rest))
                    else:
                        request.settle(rest[0], CAPACITY)
                if gkeys:
                    launched.append(Op("store", peer_id, peer, gkeys, glocal, slots, request))
                    self._launch(launched[-1])
            ready = self._after_submit(request, groups)
            for peer_id in groups:  # after the commits of what completed already
                peer = self._peers[peer_id]
                if isinstance(peer.slots, SharedSlots):
                    self._refill(peer)
            for op in launched:
                self._track_store(op)
        resolve(ready)
        return request.future

    def load(self, keys: Sequence[Key], local_idxs: Sequence[int]) -> Future[TransferResult]:
        """Bring the blocks stored under ``keys`` into arena blocks ``local_idxs``. Never blocks.

        A key that is not stored fails with "missing"; the others still load. The remote slots
        being read are pinned (never evicted or reused) until the read completes.
        """
        keys = check_keys(keys)
        local = self._check_local(local_idxs, len(keys), unique=True)
        request = Request(keys)
        with self._lock:
            self._check_open()
            groups, missing = self._index.pin(keys, local)
            request.settle(missing, MISSING)
            peer_ids = []
            for slots, (gkeys, glocal, remote) in groups.items():
                peer_id = slots.peer_id
                peer = self._peers[peer_id]
                if isinstance(slots, SharedSlots):
                    self._pin(peer, gkeys, glocal, request)
                    continue
                peer_ids.append(peer_id)
                self._launch(Op("load", peer_id, peer, gkeys, glocal, remote, request))
            ready = self._after_submit(request, peer_ids)
        resolve(ready)
        return request.future

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are stored (the prefix a scheduler can load)."""
        with self._lock:
            return self._index.lookup(keys)

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._index.where

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark stored ``keys`` as recently used, so a full peer evicts them last (unknown keys
        are ignored)."""
        with self._lock:
            where = self._index.where
            self._touch_shared(self._index.touch([key for key in keys if key in where]))

    def discard(self, keys: Sequence[Key]) -> None:
        """Forget ``keys`` (unknown ones are ignored); a store in flight will not publish them."""
        with self._lock:
            for key in keys:
                op = self._storing.pop(key, None)  # a later store of key starts afresh
                if op is not None:
                    op.discarded.add(key)
            self._index.discard(keys)

    # -- observation --------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            lat = np.asarray(self._latencies_us) if self._latencies_us else np.zeros(1)
            bl = self.transport.block_len
            return TierStats(
                blocks_stored=self._blocks_stored,
                bytes_stored=self._blocks_stored * bl,
                blocks_loaded=self._blocks_loaded,
                bytes_loaded=self._blocks_loaded * bl,
                transfers_done=self._transfers_done,
                transfers_failed=self._transfers_failed,
                evictions=self._index.evictions,
                inflight=len(self._ops),
                queued=sum(len(p.queue) for p in self._peers.values()),
                keys=len(self._index.where),
                latency_p50_us=float(np.percentile(lat, 50)),
                latency_p99_us=float(np.percentile(lat, 99)),
                events_dropped=self._index.events_dropped,
                pins_expired=self._pins_expired,
                peers={
                    pid: PeerStats(p.slots.capacity, p.slots.used, p.slots.stored)
                    for pid, p in self._peers.items()
                },
            )

    def take_events(self) -> list[TierEvent]:
        """Index changes since the last call, oldest first (at most the newest 100,000).

        Events are recorded only by a tier built with ``events=True``; otherwise this is
        always empty (a tier nobody drains pays nothing for them).
        """
        with self._lock:
            return [TierEvent(*e) for e in self._index.take_events()]  # type: ignore[arg-type]

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
                self._fail_awaiting(peer, CLOSED)
            deadline = time.monotonic() + timeout
            self._cond.notify_all()
            # Writes orphaned by a dropped peer have resolved futures: nobody waits for them.
            while any(not op.orphaned for op in self._ops.values()) and time.monotonic() < deadline:
                self._cond.wait(timeout=deadline - time.monotonic())
            leftover = list(self._ops)
            if leftover:
                if any(not self._ops[tid].orphaned for tid in leftover):
                    logger.warning("closing with %d transfers in flight: cancelling", len(leftover))
                self.transport.cancel(leftover)
                for tid in leftover:
                    op = self._ops.pop(tid)
                    if not op.orphaned:
                        self._finish(op, CLOSED)
            self._stopping = True
            self._cond.notify_all()
            self._report_usage(time.perf_counter())
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
        After that it sleeps 50 us, doubling up to ``max_poll_interval_s``.
        """
        delay = 0.0
        last_activity = time.perf_counter()
        while True:
            with self._cond:
                if not self._ops:
                    delay, last_activity = 0.0, time.perf_counter()
                while not self._ops and not self._stopping:
                    self._poller_idle = True
                    if not self._cond.wait(timeout=1.0):  # idle: report the last bytes moved
                        self._report_usage(time.perf_counter())
                self._poller_idle = False
                if self._stopping:
                    return
            try:
                result = self.transport.poll()
                faults = self.transport.faulted_peers()
            except Exception:
                logger.exception("transport.poll failed; retrying")
                time.sleep(0.01)
                continue
            if result.done or result.failed or faults:
                try:
                    with self._cond:
                        self._complete(result, faults)
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
        local = block_indices(idxs, self._num_local, "local")
        if unique and len(set(local)) != n:
            raise ValueError(
                "a local block index repeats: each destination block may be loaded once"
            )
        return local

    def _launch(self, op: Op) -> None:
        if op.peer.inflight >= self.max_inflight:
            op.peer.queue.append(op)
        else:
            self._submit(op)

    def _after_submit(self, request: Request | None, peer_ids: Iterable[str]) -> list[Request]:
        """Poll the peers just submitted to, on the calling thread; wake the poller only for
        what is still in flight. Returns the settled requests, whose futures the caller resolves
        (unlocked).

        Over shared memory a transfer often finishes inside ``transfer()``: completing it here
        spares two thread switches before its future resolves. Cost: one state check per
        transfer in flight to those peers (at most ``max_inflight`` each).
        """
        peers, transport = self._peers, self.transport
        for peer_id in peer_ids:
            if peer_id not in peers:
                continue
            try:
                result = transport.poll(peer_id)
            except Exception:
                logger.exception("transport.poll(%s) failed; the poller will retry", peer_id)
                break
            if result.done or result.failed or result.peer_fault:
                self._complete(result, {peer_id: result.peer_fault} if result.peer_fault else {})
                if self._closed:  # close() waits for the last transfers
                    self._cond.notify_all()
        if self._ops and self._poller_idle:
            self._cond.notify()
        if request is not None and request.pending == 0 and not request.queued:
            request.queued = True
            self._ready.append(request)
        ready, self._ready = self._ready, []
        return ready

    def _submit(self, op: Op) -> None:
        if self._peers.get(op.peer_id) is not op.peer:  # removed or replaced meanwhile
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

    def _complete(self, result: PollResult, faults: dict[str, str]) -> None:
        """Apply what the transport reported: finish the ops, drop failed or faulted peers,
        submit what waited in the queues of the peers that got an in-flight slot back."""
        now = time.perf_counter()
        freed: list[Peer] = []  # peers whose in-flight count went down
        for tid in result.done:
            op = self._take(tid, now, freed)
            if op is not None:
                self._transfers_done += 1
                self._finish(op, None)
        lost: dict[str, str] = {}
        for tid in result.failed:
            op = self._take(tid, now, freed)
            if op is None:
                continue
            self._transfers_failed += 1
            alive = self._peers.get(op.peer_id) is op.peer
            self._finish(op, TRANSFER_FAILED if alive else PEER_LOST)
            if alive:
                lost[op.peer_id] = "failed a transfer"
        for peer_id, cause in faults.items():
            lost.setdefault(peer_id, f"is faulted ({cause})")
        for peer_id, why in lost.items():
            self._lose_peer(peer_id, why)
        for peer in freed:  # a dropped peer's queue is empty; a refused submission drops it
            while peer.queue and peer.inflight < self.max_inflight:
                self._submit(peer.queue.popleft())
        if now >= self._usage_due:
            self._report_usage(now)

    def _take(self, tid: int, now: float, freed: list[Peer]) -> Op | None:
        """The op of a transfer the transport reported, off the in-flight table; ``None`` when
        there is nothing left to settle (unknown id, or an orphaned write: its slots unfence)."""
        op = self._ops.pop(tid, None)
        if op is None:
            return None
        if op.orphaned:  # settled when its peer was dropped; only its slots waited
            if op.kind == "store":
                self._index.unfence(op.peer_id, op.remote)
            return None
        op.peer.inflight -= 1
        freed.append(op.peer)
        self._latencies_us.append((now - op.submitted) * 1e6)
        return op

    def _report_usage(self, now: float) -> None:
        """Hand the bytes moved to the peers' sessions (per period, not per transfer)."""
        self._usage_due = now + _USAGE_PERIOD_S
        for peer in self._peers.values():
            peer.report_usage()

    def _track_store(self, op: Op) -> None:
        """Let later calls join or discard a just-launched store's keys. Only a store still
        queued or in flight can be: one that completed during submission never enters
        ``_storing`` (the lock is held throughout, so no other call looked for its keys)."""
        if not op.settled:
            self._storing.update(dict.fromkeys(op.keys, op))
            op.registered = True

    def _publish(self, peer: Peer, keys: list[Key], slots: list[int]) -> None:
        """Make written ``keys`` visible; a shared host learns them with a commit."""
        self._index.publish(peer.slots, keys, slots)
        if keys and isinstance(peer.slots, SharedSlots):
            self._commit(peer, keys, slots)

    def _finish(self, op: Op, reason: str | None) -> None:
        """Apply a finished (or abandoned) op to the index and settle its requests' keys."""
        op.settled = True
        peer = op.peer if self._peers.get(op.peer_id) is op.peer else None
        n = len(op.keys)
        if op.kind == "store":
            storing = self._storing
            if reason is None and not op.discarded and peer is not None:
                # Nothing discarded: every key still maps to this op (only a discard unmaps one).
                if op.registered:
                    drain(map(storing.pop, op.keys))
                self._publish(peer, op.keys, op.remote)
            else:
                unused = []
                published_keys, published_slots = [], []
                for key, slot in zip(op.keys, op.remote):
                    if storing.get(key) is op:
                        del storing[key]
                    if reason is None and key not in op.discarded:
                        published_keys.append(key)
                        published_slots.append(slot)
                    else:
                        unused.append(slot)
                if peer is not None:
                    self._publish(peer, published_keys, published_slots)
                    self._index.release(peer.slots, unused)
            if reason is None:
                self._blocks_stored += n
                if peer is not None:
                    peer.written += n * self._block_len
        else:
            if op.pin_id:
                reason = self._unpin(op, reason)
            elif peer is not None and not isinstance(peer.slots, SharedSlots):
                self._index.unpin(peer.slots, op.remote)
            if reason is None:
                self._blocks_loaded += n
                if peer is not None:
                    peer.read += n * self._block_len
        if reason is None:
            op.owner.nbytes += n * self._block_len
        self._settle(op, reason)

    def _settle(self, op: Op, reason: str | None) -> None:
        op.owner.settle(op.keys, reason)
        self._ready_if_settled(op.owner)
        for request, keys in op.joined.items():
            request.settle(keys, reason)
            self._ready_if_settled(request)

    def _ready_if_settled(self, request: Request) -> None:
        if request.pending == 0 and not request.queued:
            request.queued = True
            self._ready.append(request)

    def _drop_peer(self, peer_id: str) -> Any:
        """Forget a peer and its keys; fail its queued ops and settle its in-flight ones as lost
        (their writes keep their slots fenced until the transport reports them). Returns its
        session (to close)."""
        peer = self._peers.pop(peer_id)
        self._index.remove_peer(peer_id)
        while peer.queue:
            self._finish(peer.queue.popleft(), PEER_LOST)
        self._fail_awaiting(peer, PEER_LOST)
        for op in self._ops.values():
            if op.peer is peer and not op.orphaned:
                op.orphaned = True
                if op.kind == "store":
                    self._index.fence(peer_id, op.remote)
                self._finish(op, PEER_LOST)
        try:
            self.transport.remove_remote_peer(peer_id)
        except Exception:
            logger.exception("removing peer %s from the transport failed", peer_id)
        peer.report_usage()
        return peer.session

    def _lose_peer(self, peer_id: str, why: str) -> None:
        """Drop a failed peer and its keys (see the failure model in the module docstring)."""
        if peer_id not in self._peers:
            return
        logger.warning("%s %s: dropping it and its keys", peer_id, why)
        session = self._drop_peer(peer_id)
        if session is not None:  # closing waits for the server: not under the lock
            threading.Thread(
                target=self._close_session, args=(peer_id, session), daemon=True
            ).start()

    def _close_session(self, peer_id: str, session: Any) -> None:
        """Return a dropped peer's lease (without the lock); once it is gone, a late write of
        the old registration can no longer hurt this tier, so its fences go, and the transfers
        it still held in flight (a frozen host's) are cancelled: nothing waits for them."""
        session.close()
        with self._lock:
            self._index.drop_fences(peer_id)
            orphans = [
                tid for tid, op in self._ops.items() if op.orphaned and op.peer.session is session
            ]
            if orphans:
                self.transport.cancel(orphans)
                drain(map(self._ops.pop, orphans))

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
            if not self._ready:
                return
            ready, self._ready = self._ready, []
        resolve(ready)


__all__ = ["TierEvent", "TierManager", "TierStats", "TransferResult"]
