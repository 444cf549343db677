"""``torch-kv-tier serve``: a remote host whose NIXL-registered DRAM pool is a shared KV cache.

The server owns one pool, a page-aligned numpy array (``make_pool``), registered with a
``NixlTransport``: nothing a host runs imports torch (~1.2 s of CPU per start). Clients write and
read its blocks one-sidedly over NIXL; the server only answers the control plane (``control``:
handshakes, heartbeats, stats, disconnects, and for shared sessions grants, commits, touches,
promotions and the events that keep every client's copy of the index current; see ``protocol`` and
``shared_service``), and fences the slots of sessions that may still write. A session is
shared by default: every session with the same config fingerprint sees the keys the others
stored. A private session leases a range of slots that it manages alone. The handshake's
checks are ``server_handshake``'s, the command line ``serve_command``'s.

Delivery: the ROUTER socket is mandatory-routed, so a frame for a session whose connection is
gone or whose queue is full is not silently dropped: that session ends (its slots held), and
the client, told ``unknown session`` at its next request, connects again.

Incoming transfers are served by the transport's own NIXL progress thread, which sleeps on the
UCX worker's events while idle (see ``transport.nixl_agent``): the same mechanism as any passive
``NixlTransport``, so this loop never calls into NIXL for progress.

A disk tier (``--disk``, ``disk_tier``) keeps blocks the pool evicts and promotes them back on a
tier's ``Promote``; the loop polls its I/O (every ``DISK_POLL_S`` while any is in flight), and
a restart on the same directories recovers and verifies what they held before ``ready``.

Threading: one loop thread (the caller of ``Server.serve``) owns the ZeroMQ socket, the
transport, the disk and every mutation. ``Server._lock`` guards the control plane (the lease
table, the shared cache, the counters) and the disk, so the metrics HTTP thread can read a
consistent ``stats()`` snapshot.
"""

from __future__ import annotations

import errno
import gc
import logging
import math
import threading
import time
from typing import Any

import numpy as np
import zmq

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.control import ControlPlane
from torch_kv_tier.remote.disk_tier import DiskTier
from torch_kv_tier.remote.leases import Session
from torch_kv_tier.remote.metrics import MetricsServer, render_prometheus
from torch_kv_tier.remote.server_config import ServerConfig, format_address
from torch_kv_tier.remote.server_handshake import Gate
from torch_kv_tier.transport import NixlTransport

logger = logging.getLogger(__name__)

__all__ = ["Server", "ServerConfig"]  # ``serve_command`` runs it

IDLE_POLL_S = 0.1  # longest wait for a control message (bounds SIGTERM latency too)
EXPIRY_PERIOD_S = 0.1  # how often leases are checked for missed heartbeats
# Index events go out at most this often (each frame wakes every follower's I/O thread, which
# shares its tier's GIL with the tier's stores, and sends that tier's commits: see
# ``session_io``); an event is pushed at once after a quiet period. 10 ms, not 5: 4 tiers storing
# on 2 cores spent 348 ms of CPU per GB against 371 (``thread-cost``, runs one after the other),
# and a key reaches other tiers about 10 ms after its store instead of 5.
EVENTS_PERIOD_S = 0.01
PAGE = 4096
DISK_POLL_S = 0.0005  # the longest wait for a control message while disk I/O is in flight
MAX_BATCH = 256  # control messages handled between two lease-expiry checks
MAX_PING_MS = (2**31 - 1) // 2  # ZeroMQ's ping period and timeout are C ints of ms
# ``zmq.POLLIN`` is an enum member: ``&`` with it runs Python's enum code (~1 us a check)
_POLLIN = int(zmq.POLLIN)


def make_pool(num_blocks: int, block_len: int) -> np.ndarray:
    """A zeroed, page-aligned ``uint8 [num_blocks, block_len]`` array: the host's pool.

    Page-aligned because a disk tier reads into it with O_DIRECT. Zeroed by writing, so that
    every page is resident before a client writes into it: a one-sided write into a page this
    process never touched costs the kernel a remote page fault per page (see ``BlockArena``).
    Raises ``MemoryError`` when it cannot be allocated.
    """
    nbytes = num_blocks * block_len
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    pool = raw[start : start + nbytes].reshape(num_blocks, block_len)
    pool.fill(0)
    return pool


def _bind_advice(code: int | None) -> str:
    """What to change when listening failed with ``code`` (an errno; "" when unknown)."""
    if code == errno.EADDRINUSE:
        return "; another process listens there: pass another --port, or --port 0 (any)"
    if code == errno.EACCES:
        return "; ports below 1024 need privileges: pass --port 1024 or above, or --port 0 (any)"
    if code in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL):
        return (
            "; --host must be an address of this machine (an IP such as 127.0.0.1, or 0.0.0.0 "
            "for every interface) or the name of one of its interfaces"
        )
    return ""


class Server:
    """The pool, its NIXL registration, the control socket and the lease table.

    Construction allocates and registers the pool and binds the control port (``address``
    holds the real port); ``serve`` runs the loop until ``stop`` is set; ``close`` releases
    everything. Raises ``OSError`` when the port cannot be bound.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._metrics: MetricsServer | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._disk: DiskTier | None = None
        self._frozen_at = -1  # namespaces made when the loop last froze the index
        try:  # the cheap steps that fail on a busy port first, then the pool
            with self._lock:  # a metrics scrape meanwhile waits for the stats to exist
                self._socket = self._bind(config.host, config.port, config.lease_timeout_s)
                endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
                self.port = int(endpoint.rsplit(":", 1)[1])
                self.address = format_address(config.host, self.port)
                self.host_id = config.host_id or self.address
                if config.metrics_port is not None:
                    self._metrics = MetricsServer(
                        config.host, config.metrics_port, lambda: render_prometheus(self.stats())
                    )
                self.pool = make_pool(config.num_blocks, config.block_len)
                self.transport = transport = NixlTransport(
                    "tkvt-server", self.pool.data, config.config_fields
                )
                self._control = ControlPlane(
                    config,
                    Gate(config.token, transport.block_len, transport.config_fingerprint),
                    self._stats_locked,
                    server_name=self.name,
                    agent_metadata=transport.get_agent_metadata(),
                    region=p.Region(
                        transport.base_addr,
                        transport.num_blocks,
                        transport.block_len,
                        transport.mem_type,
                    ),
                    host_id=self.host_id,
                )
                if config.disk_paths:
                    self._disk = self._open_disk(config)
        except BaseException:
            self.close()
            raise

    def _open_disk(self, config: ServerConfig) -> DiskTier:
        """The disk tier, with what its directories held recovered and verified."""
        from torch_kv_tier.remote.disk_store import DiskStore  # NIXL POSIX: only when asked

        store = DiskStore(
            config.disk_paths,
            config.disk_bytes,
            block_len=config.block_len,
            pool_addr=self.pool.ctypes.data,
            pool_blocks=config.num_blocks,
            pool_owner=self.pool,  # kept if the disk closes with I/O in flight
        )
        try:
            disk = DiskTier(self._control.shared.cache, store, admit_after=config.disk_admit)
            self._control.shared.disk = disk
            disk.recover()
        except BaseException:
            store.close()
            raise
        return disk

    @property
    def name(self) -> str:
        """The server's NIXL agent name (unique per process)."""
        return self.transport.agent_name

    @staticmethod
    def _bind(host: str, port: int, lease_timeout_s: float) -> zmq.Socket[bytes]:
        """The ROUTER socket, listening. It pings every connection once per lease timeout
        (ZeroMQ's heartbeat) and closes one that sends nothing after a ping (not even its
        answer, which a client's ZeroMQ I/O thread gives while its program is idle or busy)
        for two lease timeouts: a client
        frozen, or whose machine vanished, held a descriptor and buffers here for good. Its
        sessions expired by then; one that resumes finds its connection reset, and connects
        again."""
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        silent_ms = min(max(1, math.ceil(lease_timeout_s * 1e3)), MAX_PING_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, silent_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 2 * silent_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)  # larger frames: peer disconnected
        sock.setsockopt(zmq.SNDTIMEO, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable frame raises, not vanishes
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        endpoint = "tcp://" + format_address(host, port).rsplit(":", 1)[0] + f":{port or '*'}"
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"cannot listen on {endpoint}: {exc}{_bind_advice(exc.errno)}") from None
        return sock

    # -- the loop --------------------------------------------------------------------------

    def serve(self, stop: threading.Event, *, freeze_index: bool = False) -> None:
        """Answer clients and expire leases until ``stop`` is set (wakes every ``IDLE_POLL_S``).
        ``freeze_index`` (for a process that is the host alone, as ``torch-kv-tier serve``'s:
        it freezes every object of the process) keeps the index out of the garbage
        collector's walks (``_freeze_index``)."""
        assert self._socket is not None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_expiry = next_push = 0.0
        turn = time.monotonic()  # when the loop last read its socket (or found it empty)
        while not stop.is_set():
            if freeze_index:
                self._freeze_index()
            wait_s = IDLE_POLL_S
            with self._lock:
                if self._disk is not None:
                    now = time.monotonic()
                    self._disk.step(now)
                    if self._disk.busy():
                        wait_s = DISK_POLL_S
                    else:  # promotions waiting for a DRAM slot are tried again by then
                        wait_s = min(wait_s, self._disk.retry_in(now))
                if self._control.shared.cache.has_events():
                    wait_s = min(wait_s, max(0.0, next_push - time.monotonic()))
            polled = time.monotonic()
            ready = poller.poll(math.ceil(wait_s * 1e3))
            now = time.monotonic()  # the poll's time past ``wait_s`` is no listening either
            away_s = polled - turn + max(0.0, now - polled - wait_s)
            if ready:  # ``now``: its last read (a stall after it counts at the next turn)
                missed_s, now = self._drain()
                away_s += missed_s
            self._count_stall(away_s, now)
            turn = now
            if now >= next_push and self._push_events():
                next_push = now + EVENTS_PERIOD_S
            if now >= next_expiry:
                next_expiry = now + EXPIRY_PERIOD_S
                self._expire(now)

    def _count_stall(self, away_s: float, now: float) -> None:
        """The loop read no control message for ``away_s`` seconds before ``now`` (frozen,
        say by SIGSTOP, its lock held, or busy). Past a client's heartbeat period (a third of
        the lease timeout) the sessions are not charged for it: their heartbeats of that time
        were queued, more than one batch (``MAX_BATCH``) of them once a host has that many
        sessions, and the expiry check after the first batch ended the sessions whose
        heartbeats were still queued. Nor are the held slots' ``--hold-timeout``: their
        clients' releases were queued too, and a write to a frozen host may land only once it
        resumes (``_stall_s``: a shorter hold timeout shortens what counts as a stall)."""
        lease_s = self.config.lease_timeout_s
        if away_s > self._stall_s():
            logger.log(
                logging.WARNING if away_s > lease_s else logging.DEBUG,
                "the host read no control message for %.1f s (frozen, or busy): its sessions "
                "and held slots are not charged for that silence", away_s,
            )  # fmt: skip
            with self._lock:
                self._control.pause(away_s, now)

    def _stall_s(self) -> float:
        """The silence past which the loop stalled: a client's heartbeat period (a third of the
        lease timeout), or a third of a shorter ``--hold-timeout``. Past a heartbeat period
        only (10 s by default), a 2 s stall freed the slots of a 1.5 s hold the moment the host
        resumed."""
        lease_s, hold_s = self.config.lease_timeout_s, self.config.hold_timeout_s
        return min(lease_s, hold_s or lease_s) / 3

    def _freeze_index(self) -> None:
        """Keep the host's index out of the garbage collector's walks: at the loop's start (the
        pool's containers, the disk's filled by its recovery, the process's code) and once a
        namespace was made (its entries), what is alive is collected and then frozen
        (``gc.freeze``). A full collection traversed them, stalling the loop 0.23 to 0.26 s with a
        million keys in DRAM and as many on disk, 0.84 to 1.04 s with 4 M of each; with them
        frozen, none. Freezing at the start only left each namespace's entries walked, by full
        collections made more frequent (the frozen no longer count towards their threshold).
        Frozen objects are still freed when unreferenced; only a reference cycle among them is
        never collected. ``gc.freeze`` applies to the whole process: only ``serve``'s
        ``freeze_index`` asks for it, never a host embedded in another program."""
        made = self._control.shared.cache.namespaces_made
        if made != self._frozen_at:
            self._frozen_at = made
            gc.collect()
            gc.freeze()

    def _drain(self) -> tuple[float, float]:
        """Read and answer up to ``MAX_BATCH`` control messages. Returns the seconds of it the
        host did not listen, and when it last read. Not listening: all of it when messages were
        left (heartbeats may be queued behind them), else only its gaps between two reads longer
        than ``_stall_s`` (frozen, or its lock held, mid-batch). A drain that read its socket
        empty, however long it took, read every heartbeat queued meanwhile: dead clients'
        sessions are charged for it."""
        assert self._socket is not None
        long_s = self._stall_s()
        started = last = time.monotonic()
        missed = 0.0
        for _ in range(MAX_BATCH):
            # checked with ``ZMQ_EVENTS``: a ``recv`` that finds nothing raises ``zmq.Again``,
            # an exception per wake-up
            ready = int(self._socket.get(zmq.EVENTS)) & _POLLIN
            read_at = time.monotonic()  # after the check: a stall before it is counted
            if read_at - last > long_s:
                missed += read_at - last
            last = read_at
            if not ready:
                return missed, read_at
            frames = self._socket.recv_multipart(zmq.NOBLOCK)
            identity, body = frames[0], frames[1:]
            with self._lock:
                reply = self._control.answer(identity, body, time.monotonic())
                session = self._control.session_of(identity)
            if reply is not None:
                self._send(identity, p.encode(reply), session, opens=isinstance(reply, p.Accept))
        read_at = time.monotonic()
        return read_at - started, read_at

    def _push_events(self) -> bool:
        """Tell every shared session what its namespace's index gained and lost (each frame
        encoded once for all of them); whether there was anything to tell."""
        with self._lock:
            if not self._control.shared.cache.has_events():
                return False
            frames = self._control.shared.events(list(self._control.leases.sessions.values()))
        for sessions, frame in frames:
            for session in sessions:
                self._send(session.identity, frame, session)
        return True

    def _send(
        self, identity: bytes, frame: bytes, session: Session | None, *, opens: bool = False
    ) -> None:
        """Queue one frame; a session it cannot be queued for ends: its slots are held, unless
        the frame ``opens`` it (its Accept): its client never learned of it, nothing to fence."""
        assert self._socket is not None
        try:
            self._socket.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # connection gone, or its queue full
            if session is None:
                logger.info("reply to %s dropped: %s", identity.hex(), exc)
                return
            with self._lock:
                if self._control.leases.sessions.get(session.session_id) is session:
                    why = f"{'its Accept' if opens else 'a frame for it'} was not queued ({exc})"
                    self._control.end(session, clean=opens, why=why)

    def _expire(self, now: float) -> None:
        with self._lock:
            self._control.expire(now)

    # -- stats and shutdown -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A snapshot: pool geometry, leases, occupancy, client-reported bytes, counters.

        Thread-safe.
        """
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "protocol_version": p.PROTOCOL_VERSION,
            "server_name": self.name,
            "host_id": self.host_id,
            "address": self.address,
            "num_blocks": self.config.num_blocks,
            "block_len": self.config.block_len,
            **self._control.stats(now),
            "uptime_s": now - self._started,
            "metrics_port": self._metrics.port if self._metrics else None,
        }

    def close(self) -> None:
        """Stop the metrics thread, close the socket, release the NIXL registration. Idempotent."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._disk is not None:  # waits for its I/O: before the pool goes
            self._disk.close()
            self._disk = None
        transport = getattr(self, "transport", None)  # absent when construction failed early
        if transport is not None:
            transport.close()
