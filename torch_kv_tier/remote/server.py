"""``torch-kv-tier serve``: a remote host whose NIXL-registered DRAM pool is a shared KV cache.

The server owns one ``BlockArena`` registered with a ``NixlTransport``. Clients write and read
its blocks one-sidedly over NIXL; the server only answers the control plane (handshakes,
heartbeats, stats, disconnects, and for shared sessions grants, commits, pins and the events
that keep every client's copy of the index current; see ``protocol`` and ``shared_service``).
A session is shared by default: every session with the same config fingerprint sees the keys
the others stored. A private session leases a range of slots that it manages alone. The
handshake's checks are ``server_handshake``'s, the command line ``serve_command``'s.

Fencing: a session that ends without a clean disconnect (no heartbeat for ``--lease-timeout``,
a disconnect with writes in flight, or an answer or push that could not be queued for it) may
still write its slots, so its lease or uncommitted grants are held until its client releases
the session (``Release``, or the ``release`` list of its next handshake). Delivery: the ROUTER
socket is mandatory-routed, so a frame for a session whose connection is gone or whose queue
is full is not silently dropped: that session ends (held), and the client, told
``unknown session`` at its next request, connects again.

Incoming transfers are served by the transport's own NIXL progress thread, which sleeps on the
UCX worker's events while idle (see ``transport.nixl_agent``): the same mechanism as any passive
``NixlTransport``, so this loop never calls into NIXL for progress.

A disk tier (``--disk``, ``disk_tier``) keeps blocks the pool evicts and promotes them back on a
tier's ``Promote``; the loop polls its I/O (every ``DISK_POLL_S`` while any is in flight), and
a restart on the same directories recovers and verifies what they held before ``ready``.

Threading: one loop thread (the caller of ``Server.serve``) owns the ZeroMQ socket, the
transport, the disk and every mutation. ``Server._lock`` guards the lease table, the shared
cache, the disk and the counters, so the metrics HTTP thread can read a consistent
``stats()`` snapshot.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import numpy as np
import torch
import zmq

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.disk_tier import DiskTier
from torch_kv_tier.remote.leases import LeaseTable, Session
from torch_kv_tier.remote.metrics import MetricsServer, render_prometheus
from torch_kv_tier.remote.server_config import ServerConfig, format_address
from torch_kv_tier.remote.server_handshake import Gate, Refused
from torch_kv_tier.remote.shared_service import SHARED_MESSAGES, SharedService
from torch_kv_tier.transport import NixlTransport

logger = logging.getLogger(__name__)

__all__ = ["Server", "ServerConfig"]  # ``serve_command`` runs it

IDLE_POLL_S = 0.1  # longest wait for a control message (bounds SIGTERM latency too)
EXPIRY_PERIOD_S = 0.1  # how often leases are checked for missed heartbeats
# Index events go out at most this often (each frame wakes every follower's I/O thread, which
# shares its tier's GIL with the tier's stores: see ``session_io``); an event is pushed at once
# after a quiet period.
EVENTS_PERIOD_S = 0.005
PAGE = 4096
DISK_POLL_S = 0.0005  # the longest wait for a control message while disk I/O is in flight
MAX_BATCH = 256  # control messages handled between two lease-expiry checks
MAX_CLIENT_NAME = 128


class Server:
    """The pool, its NIXL registration, the control socket and the lease table.

    Construction allocates and registers the pool and binds the control port (``address``
    holds the real port); ``serve`` runs the loop until ``stop`` is set; ``close`` releases
    everything. Raises ``OSError`` when the port cannot be bound.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._leases = LeaseTable(
            config.num_blocks, config.lease_timeout_s, config.max_lease, config.max_sessions
        )
        self._shared = SharedService(
            self._leases.pool, quota=config.namespace_quota, max_granted=config.max_grant
        )
        self._last_session: Session | None = None  # the session of the message being answered
        self._counters = dict.fromkeys(
            ("handshakes_accepted", "handshakes_rejected", "bad_frames"), 0
        )
        self._started = time.monotonic()
        self._metrics: MetricsServer | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._disk: DiskTier | None = None
        try:  # the cheap steps that fail on a busy port first, then the pool
            self._socket = self._bind(config.host, config.port)
            endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self.port = int(endpoint.rsplit(":", 1)[1])
            self.address = format_address(config.host, self.port)
            self.host_id = config.host_id or self.address
            if config.metrics_port is not None:
                self._metrics = MetricsServer(
                    config.host, config.metrics_port, lambda: render_prometheus(self.stats())
                )
            self.arena = self._make_arena(config)
            self.transport = NixlTransport("tkvt-server", self.arena.tensor, config.config_fields)
            if config.disk_paths:
                self._disk = self._open_disk(config)
            self._agent_metadata = self.transport.get_agent_metadata()
            self._region = p.Region(
                self.transport.base_addr,
                self.transport.num_blocks,
                self.transport.block_len,
                self.transport.mem_type,
            )
            self._gate = Gate(
                config.token, self.transport.block_len, self.transport.config_fingerprint
            )
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _make_arena(config: ServerConfig) -> BlockArena:
        """The pool; page-aligned when a disk tier is behind it (O_DIRECT needs that)."""
        if not config.disk_paths:
            return BlockArena(config.num_blocks, config.block_len)
        nbytes = config.num_blocks * config.block_len
        raw = np.empty(nbytes + PAGE, dtype=np.uint8)
        start = -raw.ctypes.data % PAGE
        pool = torch.from_numpy(raw[start : start + nbytes])
        pool.zero_()  # every page faulted in, as ``BlockArena`` does
        return BlockArena.wrap(pool.view(config.num_blocks, config.block_len))

    def _open_disk(self, config: ServerConfig) -> DiskTier:
        """The disk tier, with what its directories held recovered and verified."""
        from torch_kv_tier.remote.disk_store import DiskStore  # NIXL POSIX: only when asked

        store = DiskStore(
            config.disk_paths,
            config.disk_bytes,
            block_len=config.block_len,
            pool_addr=self.arena.tensor.data_ptr(),
            pool_blocks=config.num_blocks,
        )
        try:
            disk = DiskTier(self._shared.cache, store, admit_after=config.disk_admit)
            self._shared.disk = disk
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
    def _bind(host: str, port: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
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
            raise OSError(f"cannot listen on {endpoint}: {exc}") from None
        return sock

    # -- the loop --------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Answer clients and expire leases until ``stop`` is set (wakes every ``IDLE_POLL_S``)."""
        assert self._socket is not None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_expiry = next_push = 0.0
        while not stop.is_set():
            wait_s = IDLE_POLL_S
            with self._lock:
                if self._disk is not None:
                    self._disk.step(time.monotonic())
                    if self._disk.busy():
                        wait_s = DISK_POLL_S
                if self._shared.cache.has_events():
                    wait_s = min(wait_s, max(0.0, next_push - time.monotonic()))
            if poller.poll(math.ceil(wait_s * 1e3)):
                self._drain()
            now = time.monotonic()
            if now >= next_push and self._push_events():
                next_push = now + EVENTS_PERIOD_S
            if now >= next_expiry:
                next_expiry = now + EXPIRY_PERIOD_S
                self._expire(now)

    def _drain(self) -> None:
        assert self._socket is not None
        for _ in range(MAX_BATCH):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            with self._lock:
                reply = self._answer(identity, body, time.monotonic())
            if reply is not None:
                self._send(identity, p.encode(reply), self._session_of(identity))

    def _push_events(self) -> bool:
        """Tell every shared session what its namespace's index gained and lost (each frame
        encoded once for all of them); whether there was anything to tell."""
        with self._lock:
            if not self._shared.cache.has_events():
                return False
            frames = self._shared.events(list(self._leases.sessions.values()))
        for sessions, frame in frames:
            for session in sessions:
                self._send(session.identity, frame, session)
        return True

    def _send(self, identity: bytes, frame: bytes, session: Session | None) -> None:
        """Queue one frame; a session it cannot be queued for ends (its slots are held)."""
        assert self._socket is not None
        try:
            self._socket.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # connection gone, or its queue full
            if session is None:
                logger.info("reply to %s dropped: %s", identity.hex(), exc)
                return
            with self._lock:
                if self._leases.sessions.get(session.session_id) is session:
                    self._end(session, clean=False, why=f"a frame for it was not queued ({exc})")

    def _session_of(self, identity: bytes) -> Session | None:
        """The live session last heard from over ``identity`` (caller: the loop thread)."""
        session = self._last_session
        return session if session is not None and session.identity == identity else None

    def _end(self, session: Session, *, clean: bool, why: str) -> None:
        """End ``session``: free its slots (``clean``) or hold them (caller holds the lock)."""
        now = time.monotonic()
        self._leases.close(session.session_id, now, clean=clean)
        if session.shared:
            self._shared.leave(session, now, clean=clean)
        logger.log(
            logging.INFO if clean else logging.WARNING,
            "session %s (%s): %s; %s",
            session.public_id,
            session.client_name,
            why,
            "its slots are free" if clean else "its slots are held until its client releases them",
        )

    def _expire(self, now: float) -> None:
        with self._lock:
            hold = self.config.hold_timeout_s
            if hold is not None:
                late = self._leases.held_since(now - hold)
                late += self._shared.cache.held_since(now - hold)
                if late:
                    logger.warning(
                        "%d ended sessions never released their slots in %.0f s "
                        "(--hold-timeout): their slots go back to the pool",
                        len(late),
                        hold,
                    )
                    self._release(late)
            for session in self._leases.expire(now):
                if session.shared:
                    self._shared.leave(session, now, clean=False)
                logger.warning(
                    "session %s (%s): no heartbeat for %.1f s; lease %s and grants held until "
                    "its client releases them",
                    session.public_id,
                    session.client_name,
                    now - session.last_seen,
                    _span(session.lease),
                )
            self._gate.expire(now)

    # -- message handling (caller holds self._lock) ----------------------------------------

    def _answer(self, identity: bytes, body: list[bytes], now: float) -> p.ServerMessage | None:
        if len(body) != 1:
            return self._bad(f"expected one frame per message, got {len(body)}")
        try:
            message = p.decode_client(body[0])
        except p.BadFrame as exc:
            return self._bad(str(exc))
        self._last_session = None
        if isinstance(message, p.Hello):
            return self._hello(identity, message, now)
        if isinstance(message, p.Handshake):
            return self._handshake(identity, message, now)
        if isinstance(message, p.StatsRequest):
            return self._stats_request(message, now)
        session = self._leases.touch(message.session_id, now)
        if session is None:
            return p.Error(message.seq, p.UNKNOWN_SESSION)
        # A reset connection reconnects under a new routing id: answers and pushes follow it.
        session.identity = identity
        self._last_session = session
        if isinstance(message, p.Heartbeat):
            return self._heartbeat(session, message)
        if isinstance(message, SHARED_MESSAGES):
            return self._shared.answer(session, message, now)
        if isinstance(message, p.Release):
            self._release(message.held[: p.MAX_RELEASE])
            return None
        return self._disconnect(session, message)

    def _bad(self, reason: str) -> p.Error:
        self._counters["bad_frames"] += 1
        logger.info("bad control frame: %s", reason)
        return p.Error(0, reason)

    def _reject(self, seq: int, client_name: str, reason: str) -> p.Reject:
        self._counters["handshakes_rejected"] += 1
        logger.info("handshake from %r rejected: %s", client_name, reason)
        return p.Reject(seq, reason)

    def _hello(self, identity: bytes, hello: p.Hello, now: float) -> p.ServerMessage:
        try:
            return self._gate.hello(identity, hello, now)
        except Refused as exc:
            return self._reject(hello.seq, "?", str(exc))
        except p.BadFrame as exc:
            return self._bad(str(exc))

    def _handshake(self, identity: bytes, hs: p.Handshake, now: float) -> p.ServerMessage:
        name = hs.client_name[:MAX_CLIENT_NAME]
        try:
            self._gate.check(identity, hs, now)
        except Refused as exc:
            return self._reject(hs.seq, name, str(exc))
        self._release(hs.release[: p.MAX_RELEASE])
        if len(self._leases.sessions) >= self._leases.max_sessions:
            return self._reject(
                hs.seq, name, f"too many sessions (--max-sessions {self._leases.max_sessions})"
            )
        session = self._leases.open(name, hs.slots, now, private=hs.private)
        if session is None:
            held = self._leases.held_blocks
            return self._reject(
                hs.seq,
                name,
                "no free slots"
                + (f" ({held} held for clients that may still write)" if held else ""),
            )
        self._counters["handshakes_accepted"] += 1
        session.identity = identity
        if session.shared:
            session.namespace = hs.config_fingerprint
            self._shared.join(session)
            logger.info(
                "session %s (%s): shared, namespace %r",
                session.public_id,
                name,
                session.namespace[:16],
            )
        else:
            logger.info(
                "session %s (%s): private lease %s (%d slots)",
                session.public_id,
                name,
                _span(session.lease),
                len(session.lease),
            )
        return p.Accept(
            seq=hs.seq,
            session_id=session.session_id,
            public_id=session.public_id,
            server_name=self.name,
            agent_metadata=self._agent_metadata,
            region=self._region,
            lease_start=session.lease.start,
            lease_stop=session.lease.stop,
            lease_timeout_s=self._leases.lease_timeout_s,
            shared=session.shared,
            host_id=self.host_id,
            max_granted=self._shared.cache.max_granted if session.shared else 0,
        )

    def _heartbeat(self, session: Session, hb: p.Heartbeat) -> p.ServerMessage:
        _count_bytes(session, hb)
        session.slots_used = min(max(hb.slots_used, 0), len(session.lease))
        return p.HeartbeatAck(hb.seq, self._shared.event_seq(session) if session.shared else -1)

    def _release(self, session_ids: list[str]) -> None:
        """Earlier sessions whose client reported every write resolved: free what they held.
        A session this server still counts live (its client gave it up while this server was
        frozen or slow, before it expired here) ends now, clean: nothing of it is in flight."""
        if not session_ids:
            return
        for sid in session_ids:
            session = self._leases.sessions.get(sid)
            if session is not None:
                self._end(session, clean=True, why="released by its client, which moved on")
        freed = self._leases.release(session_ids) + self._shared.cache.release(session_ids)
        if freed:
            logger.info("released %d held slots of %d ended sessions", freed, len(session_ids))

    def _stats_request(self, req: p.StatsRequest, now: float) -> p.ServerMessage:
        known = self._leases.touch(req.session_id, now) is not None
        if self.config.token and not known:
            return p.Error(req.seq, p.UNKNOWN_SESSION)
        return p.StatsReply(req.seq, self._stats_locked())

    def _disconnect(self, session: Session, req: p.Disconnect) -> p.ServerMessage:
        _count_bytes(session, req)
        self._last_session = None  # ended: its ack has no session to end if undeliverable
        self._end(
            session,
            clean=req.clean,
            why=f"disconnected {'cleanly' if req.clean else 'with writes in flight'}",
        )
        return p.DisconnectAck(req.seq)

    # -- stats and shutdown -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A snapshot: pool geometry, leases, occupancy, client-reported bytes, counters.

        Thread-safe.
        """
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> dict[str, Any]:
        now = time.monotonic()
        table = self._leases
        sessions = list(table.sessions.values())
        leased = sum(len(s.lease) for s in sessions)
        shared = self._shared.stats()
        in_use = leased + shared["shared_stored_blocks"] + shared["shared_granted_blocks"]
        held = table.held_blocks + shared["shared_held_blocks"]
        return {
            "protocol_version": p.PROTOCOL_VERSION,
            "server_name": self.name,
            "host_id": self.host_id,
            "address": self.address,
            "num_blocks": self.config.num_blocks,
            "block_len": self.config.block_len,
            "free_blocks": self.config.num_blocks - in_use - held,
            "leased_blocks": leased,
            "held_blocks": held,
            "held_sessions": len(table.held) + shared["shared_held_sessions"],
            "occupancy": in_use / self.config.num_blocks,
            "slots_used": sum(s.slots_used for s in sessions),
            "lease_timeout_s": table.lease_timeout_s,
            "leases_reclaimed": table.reclaimed,
            "bytes_written": table.retired_bytes_written + sum(s.bytes_written for s in sessions),
            "bytes_read": table.retired_bytes_read + sum(s.bytes_read for s in sessions),
            "uptime_s": now - self._started,
            "metrics_port": self._metrics.port if self._metrics else None,
            **shared,
            "sessions": [
                {
                    "public_id": s.public_id,
                    "client_name": s.client_name,
                    "shared": s.shared,
                    "lease": [s.lease.start, s.lease.stop],
                    "age_s": now - s.started,
                    "idle_s": now - s.last_seen,
                    "bytes_written": s.bytes_written,
                    "bytes_read": s.bytes_read,
                    "slots_used": s.slots_used,
                }
                for s in sessions
            ],
            **self._counters,
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


def _count_bytes(session: Session, report: p.Heartbeat | p.Disconnect) -> None:
    """Take a client's cumulative byte counts (they only grow; negative values are ignored)."""
    session.bytes_written = max(session.bytes_written, report.bytes_written)
    session.bytes_read = max(session.bytes_read, report.bytes_read)


def _span(lease: range) -> str:
    return f"[{lease.start}, {lease.stop})"
