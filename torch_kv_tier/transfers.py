"""The transfer half of ``TierManager``: submitting ops, draining what the transport reports,
applying finished stores and loads to the index, and dropping peers that failed.

``Transfers`` is a part of ``TierManager`` (its base class, beside ``SharedHosts`` and
``ConnectedHosts``), kept in its own file because it is one concept: the life of a transfer,
from ``_launch`` (submit, or queue behind ``max_inflight``) through ``_complete`` (the
transport's report) to ``_finish`` (its base ``finishes.Finishes``: one method per
operation, then the requests' keys). A peer that
fails is dropped by ``_drop_peer``: its stores settle at once, its loads when the transport
reports them (their blocks may still be written until then), and its writes in flight keep
their slots fenced and its session unclean. A write that failed keeps them so for good: part of
it may still land (NIXL reports a failure while other parts are in flight), unless the
transport's failures are final (``DataTransport.failures_are_final``: it fences them first);
a read that failed so keeps its load unresolved until the tier closes (``_stranded``), and its
blocks refused to other loads and stores meanwhile (``withheld``). A transfer the transport
still holds ``transfer_timeout_s`` after its post faults its peer likewise
(``Poller._expire_overdue``, see ``overdue``): a load of it settles "timed out" then, its blocks
withheld until the transport reports it.

Its base ``poller.Poller`` is the thread that drains the transport. Threading: every method
runs with the manager's lock held, except ``_flush`` (called without it: it resolves futures,
whose callbacks may call back into the manager).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.digest import BlockDigests
from torch_kv_tier.ended_sessions import EndedSessions
from torch_kv_tier.finishes import Finishes
from torch_kv_tier.index import BlockIndex, drain
from torch_kv_tier.keys import Key
from torch_kv_tier.overdue import Overdue
from torch_kv_tier.poller import Poller
from torch_kv_tier.promotions import Parked, Promotions
from torch_kv_tier.records import Op, Peer, Request, resolve
from torch_kv_tier.results import (
    CAPACITY,
    PEER_LOST,
    TRANSFER_FAILED,
    Counters,
)
from torch_kv_tier.shared_host import SharedHost
from torch_kv_tier.tier_threads import on_tier_thread
from torch_kv_tier.transport.base import DataTransport, PollResult
from torch_kv_tier.withheld import WithheldReads

logger = logging.getLogger(__name__)

_USAGE_PERIOD_S = 0.25  # bytes moved reach a peer's session at most this often (heartbeat: 1 s)


class Transfers(Poller, Finishes):
    """Transfer lifecycle of ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    transport: DataTransport
    max_inflight: int
    _lock: DeferringLock
    _cond: threading.Condition
    _closed: bool
    _stopping: bool
    _poller_idle: bool
    _index: BlockIndex
    _digests: BlockDigests
    _peers: dict[str, Peer]
    _storing: dict[Key, Op]
    _ops: dict[int, Op]
    _overdue: Overdue
    _withheld: WithheldReads
    _ready: list[Request]
    _promotions: Promotions
    _ended: EndedSessions
    _block_len: int
    _max_poll_interval_s: float
    _usage_due: float
    _counters: Counters

    if TYPE_CHECKING:  # implemented by SharedHosts and ConnectedHosts

        def _refill(self, host: SharedHost) -> None: ...
        def _launch_awaiting(self, host: SharedHost) -> bool: ...
        def _fail_awaiting(self, peer: Peer, reason: str) -> None: ...
        def _send_releases(self, address: str) -> None: ...
        def _end_later(self, session: Any, clean: bool) -> None: ...
        def _fail_parked(self, parked: list[Parked], reason: str) -> None: ...

    def _store_on(
        self, peer: Peer, keys: list[Key], local: list[int], digests: list[int], request: Request
    ) -> None:
        """Reserve slots of ``peer`` for a group of a store and launch it; keys no slot was
        found for fail with "capacity" (a private peer) or wait for the host's next grant."""
        op = Op("store", peer.slots.peer_id, peer, keys, local, [], request, digests)
        self._storing.update(dict.fromkeys(keys, op))
        op.remote = peer.take_slots(self._index, len(keys))
        if len(op.remote) < len(keys):
            rest = op.split(len(op.remote))
            if isinstance(peer, SharedHost):  # waits for the host's next grant
                self._storing.update(dict.fromkeys(rest.keys, rest))
                peer.awaiting.append(rest)
            else:
                drain(map(self._storing.pop, rest.keys))
                request.settle(rest.keys, CAPACITY)
        if op.keys:
            self._launch(op)

    def _launch(self, op: Op) -> None:
        if op.peer.inflight >= self.max_inflight:
            op.peer.queue.append(op)
        else:
            self._submit(op)

    def _submitted(self, request: Request | None, peer_ids: Iterable[str]) -> None:
        """Poll the peers just submitted to, on the calling thread; wake the poller only for
        what is still in flight; ``request`` joins the settled ones (``_ready``) if it is.
        The caller resolves them once unlocked (``_flush``: a Ctrl-C before that loses none).

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
        if request is not None:
            self._ready_if_settled(request)

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
            self._counters.transfers_failed += 1
            if not self._stranded(op):  # (refused, yet part of a read may have been sent)
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
            op = self._take(tid, now, freed, failed=False)
            if op is not None:
                self._counters.transfers_done += 1
                self._finish(op, None)
        lost: dict[str, str] = {}
        for tid in result.failed:
            op = self._take(tid, now, freed, failed=True)
            if op is None:
                continue
            self._counters.transfers_failed += 1
            alive = self._peers.get(op.peer_id) is op.peer
            if not self._stranded(op):
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

    def _take(self, tid: int, now: float, freed: list[Peer], *, failed: bool) -> Op | None:
        """The op of a transfer the transport reported, off the in-flight table; ``None`` when
        there is nothing left to do but its aftermath (unknown id, or an op orphaned by its
        peer's drop: a store's slots unfence and its ended session may be released, unless it
        ``failed`` and failures are not final: then part of it may still land; a load's request
        settles now that nothing lands in its blocks any more, unless it ``failed`` and
        failures are not final: ``_stranded``)."""
        op = self._ops.pop(tid, None)
        if op is None:
            return None
        self._withheld.reported(tid)  # (a failed read that may still land: ``_stranded``)
        if op.orphaned:
            if op.kind == "load":
                if not (failed and self._stranded(op)):
                    self._settle(op, [], PEER_LOST)
            elif failed and not self.transport.failures_are_final:
                logger.warning(
                    "a write to %s, dropped meanwhile, failed: its slots stay fenced and its "
                    "session is held (part of it may still land)",
                    op.peer_id,
                )
            else:
                self._index.unfence(op.peer_id, op.remote)
                if op.peer.session is not None and self._ended.write_resolved(op.peer.session):
                    self._send_releases(op.peer.session.address)
            return None
        op.peer.inflight -= 1
        freed.append(op.peer)
        self._counters.latencies_us.append((now - op.submitted) * 1e6)
        return op

    def _stranded(self, op: Op) -> bool:
        """Whether ``op``, which failed (or was refused), is a load stranded: on a transport
        whose failures are not final, part of its read may still land in its blocks, whenever,
        and nothing will say when it can no longer. Its keys settle only once the transport is
        released (``close``), so that its caller never reuses those blocks for another load
        whose verified bytes a stray read would overwrite (a load into them raises meanwhile,
        ``withheld``); its peer is dropped by the caller. ``False`` (the caller settles it): a
        store, or failures that are final."""
        if op.kind != "load" or self.transport.failures_are_final:
            return False
        logger.warning(
            "a read of %d blocks from %s failed and may still land (the transport's failures "
            "are not final): its load resolves when the tier closes",
            len(op.keys),
            op.peer_id,
        )
        self._withheld.strand(op)
        return True

    def _report_usage(self, now: float) -> None:
        """Hand the bytes moved to the peers' sessions (per period, not per transfer)."""
        self._usage_due = now + _USAGE_PERIOD_S
        for peer in self._peers.values():
            peer.report_usage()

    def _drop_peer(self, peer_id: str, *, lost: bool = False) -> tuple[Any, bool]:
        """Forget a peer and its keys; fail its queued ops, settle its in-flight stores as lost
        (their writes keep their slots fenced until the transport reports them) and leave its
        in-flight loads to settle when the transport reports them. Returns its session (to
        end) and whether that may be clean (no write of it in flight). A ``lost`` peer is
        dropped from the transport (``drop_remote_peer``: it will be dialled again)."""
        self._counters.peers_dropped += 1
        peer = self._peers.pop(peer_id)
        self._index.remove_peer(peer_id)
        while peer.queue:
            self._finish(peer.queue.popleft(), PEER_LOST)
        self._fail_awaiting(peer, PEER_LOST)
        self._fail_parked(self._promotions.take(peer_id), PEER_LOST)
        writes = peer.lost_writes  # never resolved: the host holds them until its hold ends
        for op in self._ops.values():
            if op.peer is peer and not op.orphaned:
                op.orphaned = True
                if op.kind == "store":
                    writes += 1
                    self._index.fence(peer_id, op.remote)
                    self._finish(op, PEER_LOST)
        try:
            if lost:
                self.transport.drop_remote_peer(peer_id)
            else:
                self.transport.remove_remote_peer(peer_id)
        except Exception:
            logger.exception("removing peer %s from the transport failed", peer_id)
        peer.report_usage()
        if peer.session is not None:
            self._ended.ended(peer.session, writes)
        return peer.session, writes == 0

    def _lose_peer(self, peer_id: str, why: str) -> None:
        """Drop a failed peer and its keys (see the failure model in the module docstring);
        a connected host is dialled again once its session ended. Not once ``close`` took the
        peers' sessions (``_stopping``): it ends them, and knows which of their writes it
        cancelled in flight (a second end, clean, would let the host free their slots)."""
        if peer_id not in self._peers or self._stopping:
            return
        logger.warning("%s %s: dropping it and its keys", peer_id, why)
        session, clean = self._drop_peer(peer_id, lost=True)
        if session is not None:  # ending waits for the host: not here (``_end_later``)
            self._end_later(session, clean)

    def _flush(self) -> None:
        """Resolve settled futures (and those of blocks no late read may write any more),
        unlocked; those a ``KeyboardInterrupt`` left unresolved (a Ctrl-C, a done-callback's,
        also one raised as the lock is released: ``DeferringLock``) go back to ``_ready`` for
        the next flush (``close``'s retry, the poller's next turn), then it is raised.

        On one of the tier's own threads (``tier_threads``: the poller, a session's I/O thread,
        the redialer's, membership's, those ending sessions) it is logged instead, and the
        flush goes on: no user is there to interrupt (a Ctrl-C reaches the main thread only),
        and raised it ended that thread (a session's I/O thread so left its session silent,
        never reported lost; membership followed its source no more)."""
        while True:
            try:
                self._resolve_ready()
                return
            except KeyboardInterrupt:
                if not on_tier_thread():
                    raise
                logger.exception(
                    "a done-callback raised KeyboardInterrupt on the tier's thread %r: it goes on",
                    threading.current_thread().name,
                )

    def _resolve_ready(self) -> None:
        """``_flush``'s one pass: resolve what is ready, put back what an interrupt left."""
        ready: list[Request] = []
        try:
            with self._lock:  # (taken in one line: no interrupt between)
                ready, self._ready = [*self._ready, *self._withheld.cleared()], []
            resolve(ready)
        except BaseException:
            with self._lock:
                self._ready[:0] = [r for r in ready if not r.future.done()]
            raise
