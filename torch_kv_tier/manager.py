"""``TierManager``: logical KV block keys kept on remote peers, moved by NIXL transfers.

The public API and the calls' validation. Its parts: ``index`` (what is stored where:
placement, slot pools, LRU, pins, fences), ``records`` (per call, per transfer, per tier-owned
peer), ``shared_host`` (one shared host's grants, waiting stores and commits), ``digest``, and
the base classes ``transfers`` (a transfer's life: submit, poll, drop a failed peer; its bases
``finishes``: finish, settle; ``poller``: its thread), ``shared_hosts`` (driving shared hosts),
``connected_hosts`` (``connect``, ``disconnect`` and the sessions; its base ``private_regions``:
``add_peer``'s and private leases' regions; that one's base ``lost_hosts``: a lost session, the
redial; and its base ``session_releases``), ``key_queries``
(``lookup``, ``contains``, ``holders``, ``prefetch``, ``touch``, ``discard``),
``tier_observation`` (``stats``, ``take_events``) and ``closing`` (``close``: cancel, end the
sessions, settle the loads); the constructor's checks: ``manager_args``;
the factory ``create`` (a fresh arena and NIXL transport): ``manager_create``.

Threading: any thread may call any method. ``_lock`` (with its condition ``_cond``) guards every
table. A call submits its transfers and polls the peers it submitted to on the calling thread:
a transfer NIXL finished during submission completes there, and the background poller is not
woken. The poller runs only while transfers are in flight, and sleeps on ``_cond`` otherwise.
Futures are resolved, and their callbacks run, *outside* the lock (on the calling thread, or on
one of the tier's own threads: the poller, a host session's I/O thread, a thread that connects,
redials or follows membership), so a callback may call back into the manager and read its own
(done) future. On the tier's threads a wait for a future not yet done (``result()``,
``exception()``) raises ``RuntimeError`` at once, whatever its timeout (``tier_threads``): it
would hold a thread that the transfer waited for may need (on the poller nothing polls it
meanwhile; a session's I/O thread answers that session's grants and heartbeats). A retry in a
callback chains its own callback, or waits on a thread of its own; ``concurrent.futures.wait``
and ``as_completed`` bypass the check (they would wait there as before): never call them in a
callback. A future settled by a host's loss settles after that host left placement, ``peers()``,
``contains``/``lookup`` and ``stats()`` (``peers_dropped``; its keys' "lost" events are
recorded first), so a retry at once goes to another host. Registering a peer's region with NIXL
(seconds for a big pool) runs outside the lock: lookups and transfers go on meanwhile.

The guarantee: a load returns the bytes its key names, or fails the key. Every store computes
the digest of each block it writes; every load recomputes the digests of what it read and
reports a key whose bytes differ as "missing" (``stats().verify_failed``), whatever wrote the
remote slot meanwhile. A load's future resolves only once the transport can no longer write
into its local blocks, except a read past ``transfer_timeout_s``: its load settles "timed out"
then, and its blocks are refused to every load and store until the transport reports that read.

Failure model: a transfer that fails fails its keys, and its peer is dropped with its keys (a
cache entry that cannot be trusted is cheaper to recompute than to serve); so does a peer the
transport reports faulted and a connected host whose session is lost (it is dialled again in
the background). A dropped peer's stores resolve at once ("peer lost"), its loads when the
transport reports them. A write the transport still holds after its peer was dropped may yet
land: its remote slots stay out of every pool of that peer id here, and its session counts as
unclean, so the host holds the session's slots until this tier tells it
(``ended_sessions.EndedSessions``) that the transport reported the last such write. A write that
failed may land part-way later: its slots and session stay so for good (the host's hold ends
it). Likewise a read that failed on a transport whose failures are not final
(``DataTransport.failures_are_final`` False) may land part-way later: its load resolves only
when the tier closes, so its blocks are never handed back to a caller meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from torch_kv_tier import manager_create
from torch_kv_tier.arena import BlockArena
from torch_kv_tier.closing import Closing
from torch_kv_tier.connected_hosts import ConnectedHosts
from torch_kv_tier.connections import Dial, Joining, Redialer
from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.digest import BlockDigests
from torch_kv_tier.ended_sessions import EndedSessions
from torch_kv_tier.index import BlockIndex
from torch_kv_tier.key_queries import KeyQueries
from torch_kv_tier.keys import Key, check_keys
from torch_kv_tier.manager_args import check_flags, check_region, tier_settings
from torch_kv_tier.overdue import TRANSFER_TIMEOUT_S, Overdue
from torch_kv_tier.promotions import Promotions
from torch_kv_tier.records import Op, Peer, Request, joined_peers, resolve, split_new
from torch_kv_tier.remote.quantities import seconds
from torch_kv_tier.results import (
    MISSING,
    NO_PEERS,
    TIER_CLOSED,
    Counters,
    TierEvent,
    TierStats,
    TransferResult,
)
from torch_kv_tier.session_ends import SessionEnds
from torch_kv_tier.shared_host import SharedHost
from torch_kv_tier.shared_hosts import SharedHosts
from torch_kv_tier.tier_observation import Observation
from torch_kv_tier.tier_threads import TierThread
from torch_kv_tier.transfers import Transfers
from torch_kv_tier.transport.base import DataTransport, block_indices
from torch_kv_tier.withheld import WithheldReads

logger = logging.getLogger(__name__)

_LATENCY_WINDOW = 4096
PROMOTION_TIMEOUT_S = 5.0  # a load of a key on a host's disk waits this long for its promotion


class TierManager(Closing, Transfers, SharedHosts, ConnectedHosts, KeyQueries, Observation):
    """Keeps KV blocks under logical keys on remote peers and brings them back.

    ``store`` and ``load`` never block: they return futures, resolved on the calling thread when
    the transfer finished during submission, else by a background thread draining
    ``transport.poll()``. Each key has one remote home chosen by rendezvous hashing over the
    peers' stable ids; a key is visible to ``lookup``/``contains``/``load`` only once its write
    completed. A full peer evicts its least recently used keys (never one being loaded). At
    most ``max_inflight`` transfers per peer are submitted at once; the rest wait in that peer's
    queue, in order, so a stalled peer holds back no other. Index events (``take_events``) are
    recorded only when the tier is built with ``events=True``.

    ``verify=False`` skips the digests of private peers' blocks (loads then trust that nothing
    but this tier wrote its slots, which fencing keeps true, see the module docstring); a shared
    host's loads are always verified, since nothing pins what they read. ``compact_index``: how
    the copy of a shared host's index is held (``index.BlockIndex``; ``None``: a dict until the
    hosts followed add up to 2**20 slots, then 16 B per key).

    ``transfer_timeout_s``: how long a transfer may stay posted before its peer is dropped as
    if it refused it (0: never; see ``overdue``, where the default's reasons are): its stores
    settle "peer lost", a load "timed out", its blocks withheld until the transport reports
    its read (a load into them or a store from them raises ``ValueError``). With
    ``settle_late_loads=False`` such a load settles only when the transport reports its read,
    and nothing is withheld: for a caller that reuses a failed load's blocks at once.

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
        grant_batch: int | None = None,
        verify: bool = True,
        compact_index: bool | None = None,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        settle_late_loads: bool = True,
    ) -> None:
        check_region(arena, transport)
        check_flags(verify=verify, events=events, compact_index=compact_index)
        max_inflight, self.grant_batch = tier_settings(max_inflight, grant_batch, arena.block_len)
        # the poller sleeps up to this long
        max_poll_interval_s = seconds("max_poll_interval_s", max_poll_interval_s, zero=True)
        overdue = Overdue(transfer_timeout_s, settle_loads=settle_late_loads)
        self.verify = verify
        self.arena = arena
        self.transport = transport
        self._digests = BlockDigests(arena.tensor)
        self._num_local, self._block_len = transport.num_blocks, transport.block_len
        self.max_inflight = max_inflight
        self._max_poll_interval_s = max_poll_interval_s
        self._lock = DeferringLock()
        self._cond = threading.Condition(self._lock)  # type: ignore[arg-type]
        self._index = BlockIndex(events=events, compact=compact_index)
        self._peers: dict[str, Peer] = {}
        self._storing: dict[Key, Op] = {}  # key -> its store in flight, queued or awaiting slots
        self._promotions = Promotions()  # loads waiting for keys on a host's disk
        self.promotion_timeout_s = PROMOTION_TIMEOUT_S
        self._ops: dict[int, Op] = {}  # transfer id -> op the transport holds
        self._overdue = overdue  # transfers past the bound
        self._withheld = WithheldReads()  # stranded and late reads: their blocks refused
        self._ready: list[Request] = []  # settled requests whose futures are not yet resolved
        self._dials: dict[str, Dial] = {}  # connected host's peer id -> how to dial it again
        self._joining: dict[str, Joining] = {}  # peer id -> its connect in progress
        self._agent_metadata: bytes | None = None  # what handshakes say (``ConnectedHosts``)
        self._removed: dict[str, Dial] = {}  # address -> how a host the user removed was dialled
        self._pending: dict[str, Dial] = {}  # address -> how to dial a host down at its connect
        self._redialing: list[Dial] = []  # the redialer's connects in progress
        self._ended = EndedSessions()
        self._redialer = Redialer(self._redial, self._wants_dial)
        self._session_ends = SessionEnds(self._end_dropped, self._rearm_redialer)
        self._closing = threading.Event()
        self._join_turn = threading.Lock()
        self._counters = Counters(_LATENCY_WINDOW)
        self._usage_due = 0.0  # perf_counter time of the next usage report to the sessions
        self._poller_idle = False
        self._closed = False
        self._stopping = False
        self._thread = TierThread(target=self._run, name="tkvt-poller", daemon=True)
        self._session_ends.start()
        try:
            self._thread.start()
        except BaseException:  # (the thread limit: no thread of this tier left running)
            self._session_ends.stop(timeout=1.0)
            raise

    create = classmethod(manager_create.create)  # the factory: see its module

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
        Raises ``TypeError``/``ValueError`` for a bad region (before anything is dropped), or
        what NIXL raised when it cannot register it.
        """
        self._add_private(peer_id, agent_metadata, base_addr, num_blocks, block_len, slots, None)

    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer: its pending futures fail with "peer lost", its keys are dropped; a
        connected host is not dialled again. Given the address of a host that
        ``connect(..., redial_if_down=True)`` still dials (it never joined: it has no peer id
        yet), that dial stops (``cancel_dial``).

        Raises ``KeyError`` for an unknown peer (and no such dial).
        """
        self._remove(peer_id)

    def peers(self) -> list[str]:
        """The ids of this tier's peers: ``add_peer``'s regions and its connected hosts, a host
        from when its join completed (what ``connect`` returns after: a shared host's keys are
        known here), so never one still joining (a connect or redial of it under way, whose
        join may yet fail), nor one lost and dialled again. Any thread."""
        with self._lock:
            return [peer_id for peer_id in self._peers if peer_id not in self._joining]

    def placing_peers(self) -> list[str]:
        """The ids of the peers ``store`` places keys on now (each key's home among them,
        ``keys.home_peer``): ``peers()`` and the shared hosts still joining, which take
        stores before their index is in (``peers()`` lists them once joined). For a caller
        that groups keys by the host they will go to. Any thread."""
        with self._lock:
            return list(self._peers)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (``connect``, ``store`` and ``load`` then raise)."""
        return self._closed

    # -- data ---------------------------------------------------------------------------------

    def store(
        self, keys: Sequence[Key], local_idxs: Sequence[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        """Copy arena blocks ``local_idxs`` to remote slots under ``keys``. Never blocks.

        Already-stored keys send nothing and succeed; keys whose store is in flight (or waits
        for a shared host's slots) join it. ``placed``, if given, gains the ids of the peers
        whose transfers the future waits for, each once: those this call sent keys to (as it
        placed them: a host may join as it runs), then those of the stores its keys joined (a
        key's home may have changed since that store began). Raises
        ``TypeError``/``ValueError``/``IndexError`` for bad input (``keys.check_keys`` states
        the key limits), before any transfer, and ``ValueError`` for a block a read may
        still write (``load``). The blocks must not change until the future resolves.
        """
        keys = check_keys(keys)
        local = self._check_local(local_idxs, len(keys), unique=False)
        digested = self._digest_stores()
        digests = self._digests.of(local, keys) if digested else [0] * len(keys)
        request = Request(keys)
        with self._lock:
            self._check_open()
            self._withheld.refuse(local, "store from")
            if not digested and self._digest_stores():  # a shared host joined meanwhile
                digests = self._digests.of(local, keys)
            index = self._index
            new_keys, new_local, new_digests, stored = split_new(
                index, self._storing, request, keys, local, digests
            )
            if stored:
                self._touch_shared(index.touch(stored))
                request.settle(stored, None)
            groups = index.place(new_keys, new_local, new_digests) if new_keys else {}
            if placed is not None:
                placed.extend(groups)
                if len(new_keys) + len(stored) < len(keys):  # some joined stores in flight
                    joined = joined_peers(self._storing, request, keys)
                    placed.extend(peer for peer in joined if peer not in groups)
            if new_keys and not groups:
                request.settle(new_keys, NO_PEERS)
            for peer_id, (gkeys, glocal, gdigests) in groups.items():
                self._store_on(self._peers[peer_id], gkeys, glocal, gdigests, request)
            self._submitted(request, groups)
            for peer_id in groups:  # after the commits of what completed already
                peer = self._peers.get(peer_id)  # polling may have dropped it
                if isinstance(peer, SharedHost):
                    self._refill(peer)
        self._flush()
        return request.future

    def load(
        self,
        keys: Sequence[Key],
        local_idxs: Sequence[int],
        begun: list[Future[TransferResult]] | None = None,
    ) -> Future[TransferResult]:
        """Bring the blocks stored under ``keys`` into arena blocks ``local_idxs``. Never blocks.

        A key that is not stored, or whose bytes fail their digest, fails with "missing"; the
        others still load. The future resolves once the transport can no longer write into
        ``local_idxs``: for a read that failed on a transport whose failures are not final
        (``DataTransport.failures_are_final`` False), only when the tier closes; until then a
        load into any of that read's blocks raises ``ValueError`` (its stray bytes may land).
        A read still in flight ``transfer_timeout_s`` after its post settles "timed out" then
        (its peer is dropped), but its blocks are withheld likewise (``stats().late_reads``)
        until the transport reports it or the tier closes: use other blocks meanwhile.
        ``begun``, if given, gains the future before any read is sent: a caller that a
        ``KeyboardInterrupt`` stopped in this call learns when its reads ended (empty: none
        began; one a Ctrl-C left unsettled in here may never resolve).
        """
        keys = check_keys(keys)
        local = self._check_local(local_idxs, len(keys), unique=True)
        request = Request(keys)
        if begun is not None:
            begun.append(request.future)
        with self._lock:
            self._check_open()
            self._withheld.refuse(local, "load into")
            groups, missing = self._index.locate(keys, local)
            if missing and self._index.has_disk_keys():
                missing = self._park_on_disk(request, keys, local, missing)
            request.settle(missing, MISSING)
            peer_ids = []
            for slots, (gkeys, glocal, remote, digests) in groups.items():
                peer = self._peers[slots.peer_id]
                peer_ids.append(slots.peer_id)
                self._launch(
                    Op("load", slots.peer_id, peer, gkeys, glocal, remote, request, digests)
                )
            self._submitted(request, peer_ids)
        self._flush()
        return request.future

    def withheld_until(self, local_idxs: Sequence[int]) -> Future[TransferResult]:
        """A future that resolves (with an empty result) once no read that failed or timed out
        may still write any of arena blocks ``local_idxs`` (``load``): once the transport
        reported every late read into them, or the tier closed; at once if none may now. For
        a caller that must keep a timed-out load's blocks until a load into them or a store
        from them is accepted again. Its callbacks run on the tier's thread (or this one, at
        once), never under the tier's lock. ``TypeError``/``IndexError`` for bad blocks."""
        local = self._check_local(local_idxs, len(local_idxs), unique=False)
        with self._lock:
            request = self._withheld.until_free(local)
        if request is None:
            request = Request([])
            resolve([request])
        return request.future

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals; callers hold self._lock unless noted --------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(TIER_CLOSED)

    def _check_local(self, idxs: Sequence[int], n: int, *, unique: bool) -> list[int]:
        if len(idxs) != n:
            raise ValueError(f"{n} keys need {n} local block indices, got {len(idxs)}")
        local = block_indices(idxs, self._num_local, "local")
        if unique and len(set(local)) != n:
            raise ValueError(
                "a local block index repeats: each destination block may be loaded once"
            )
        return local

    def _digest_stores(self) -> bool:
        """Whether stores compute digests: to verify private loads, or for any shared host
        (``store`` asks without the lock, from a copy of the table another thread may change,
        and asks again under it when the answer was no: a host that joined meanwhile gets real
        digests, never 0, which every tier would read as a mismatch)."""
        return self.verify or any(p.verifies for p in list(self._peers.values()))


__all__ = ["TierEvent", "TierManager", "TierStats", "TransferResult"]
