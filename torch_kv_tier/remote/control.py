"""The server's control plane: sessions, their leases and grants, and the answer to each message.

``ControlPlane`` turns one decoded client message into the server's reply (handshakes through
``server_handshake.Gate``, heartbeats, releases, disconnects; shared-session messages through
``SharedService``), ends sessions, expires the silent ones and holds the slots of every session
that may still write. It owns no socket and no memory: the ``Server`` loop receives and sends
the frames, and registers the pool the slots name.

Fencing: a session that ends without a clean disconnect (no heartbeat for ``--lease-timeout``,
a disconnect with writes in flight, or a frame the server could not queue for it) may still
write its slots, so its lease or uncommitted grants are held until its client releases the
session (``Release``, or the ``release`` list of its next handshake), or ``--hold-timeout`` of
the host listening passes (``pause``: a host's own stall counts against no session or hold).

Threading: not thread-safe. The server calls every method under its state lock, from its loop
thread (``stats`` also from the metrics thread, under the same lock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.leases import LeaseTable, Session
from torch_kv_tier.remote.server_config import ServerConfig
from torch_kv_tier.remote.server_handshake import Gate, Refused
from torch_kv_tier.remote.shared_service import SHARED_MESSAGES, SharedService

logger = logging.getLogger(__name__)

MAX_CLIENT_NAME = 128


class ControlPlane:
    """Sessions and the answers to their messages, for one server (module docstring).

    ``gate`` checks handshakes; ``server_stats()`` answers stats requests; ``accept`` goes into
    every ``Accept`` (the server's agent name and metadata, its pool's ``Region``, its host id).
    """

    def __init__(
        self,
        config: ServerConfig,
        gate: Gate,
        server_stats: Callable[[], dict[str, Any]],
        **accept: Any,
    ) -> None:
        self.config = config
        self.leases = LeaseTable(
            config.num_blocks, config.lease_timeout_s, config.max_lease, config.max_sessions
        )
        self.shared = SharedService(
            self.leases.pool, quota=config.namespace_quota, max_granted=config.max_grant
        )
        self.counters = dict.fromkeys(
            ("handshakes_accepted", "handshakes_rejected", "bad_frames"), 0
        )
        self._last_session: Session | None = None  # the session of the message being answered
        self._gate = gate
        self._server_stats = server_stats
        self._accept = accept

    def answer(self, identity: bytes, body: list[bytes], now: float) -> p.ServerMessage | None:
        """The reply to one message of ``identity`` (``None``: nothing to send back)."""
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
        session = self.leases.touch(message.session_id, now)
        if session is None:
            return p.Error(message.seq, p.UNKNOWN_SESSION)
        # A reset connection reconnects under a new routing id: answers and pushes follow it.
        session.identity = identity
        self._last_session = session
        if isinstance(message, p.Heartbeat):
            return self._heartbeat(session, message)
        if isinstance(message, SHARED_MESSAGES):
            return self.shared.answer(session, message, now)
        if isinstance(message, p.Release):
            self._release(message.held[: p.MAX_RELEASE], now)
            return None
        return self._disconnect(session, message)

    def session_of(self, identity: bytes) -> Session | None:
        """The live session the last answered message came from (or opened), if it came over
        ``identity``."""
        session = self._last_session
        return session if session is not None and session.identity == identity else None

    def end(self, session: Session, *, clean: bool, why: str) -> None:
        """End ``session``: free its slots (``clean``) or hold them."""
        now = time.monotonic()
        self.leases.close(session.session_id, now, clean=clean)
        if session.shared:
            self.shared.leave(session, now, clean=clean)
        logger.log(
            logging.INFO if clean else logging.WARNING,
            "session %s (%s): %s; %s",
            session.public_id,
            session.client_name,
            why,
            "its slots are free" if clean else "its slots are held until its client releases them",
        )

    def pause(self, seconds: float, now: float) -> None:
        """The host read no control message for ``seconds`` before ``now`` (its loop stalled):
        neither the sessions' silence nor the held slots' hold time counts that stall."""
        self.leases.pause(seconds, now)
        self.leases.held.pause(seconds, now)
        self.shared.cache.held.pause(seconds, now)

    def expire(self, now: float) -> None:
        """End the sessions that missed their heartbeats (held), and give back the slots of
        ended sessions never released within ``--hold-timeout``."""
        hold = self.config.hold_timeout_s
        if hold is not None:
            late = self.leases.held.since(now - hold) + self.shared.cache.held.since(now - hold)
            if late:
                logger.warning(
                    "%d ended sessions never released their slots in %.0f s "
                    "(--hold-timeout): their slots go back to the pool",
                    len(late),
                    hold,
                )
                self._release(late, now)
        for session in self.leases.expire(now):
            if session.shared:
                self.shared.leave(session, now, clean=False)
            logger.warning(
                "session %s (%s): no heartbeat for %.1f s; lease %s and grants held until "
                "its client releases them",
                session.public_id,
                session.client_name,
                now - session.last_seen,
                _span(session.lease),
            )
        self._gate.expire(now)

    def stats(self, now: float) -> dict[str, Any]:
        """Leases, occupancy, client-reported bytes, the shared cache's figures, the sessions
        and the counters."""
        table = self.leases
        sessions = list(table.sessions.values())
        leased = sum(len(s.lease) for s in sessions)
        shared = self.shared.stats()
        in_use = leased + shared["shared_stored_blocks"] + shared["shared_granted_blocks"]
        held = table.held.blocks + shared["shared_held_blocks"]
        num_blocks = self.config.num_blocks
        return {
            "free_blocks": num_blocks - in_use - held,
            "leased_blocks": leased,
            "held_blocks": held,
            "held_sessions": len(table.held) + shared["shared_held_sessions"],
            "occupancy": in_use / num_blocks,
            "slots_used": sum(s.slots_used for s in sessions),
            "lease_timeout_s": table.lease_timeout_s,
            "leases_reclaimed": table.reclaimed,
            "bytes_written": table.retired_bytes_written + sum(s.bytes_written for s in sessions),
            "bytes_read": table.retired_bytes_read + sum(s.bytes_read for s in sessions),
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
            **self.counters,
        }

    # -- one message kind each --------------------------------------------------------------

    def _bad(self, reason: str) -> p.Error:
        self.counters["bad_frames"] += 1
        logger.info("bad control frame: %s", reason)
        return p.Error(0, reason)

    def _reject(self, seq: int, client_name: str, reason: str) -> p.Reject:
        self.counters["handshakes_rejected"] += 1
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
        self._release(hs.release[: p.MAX_RELEASE], now)
        if len(self.leases.sessions) >= self.leases.max_sessions:
            return self._reject(
                hs.seq, name, f"{p.TOO_MANY_SESSIONS} (--max-sessions {self.leases.max_sessions})"
            )
        if hs.private:  # the slots the shared pool freed serve a lease as well
            self.shared.cache.return_free()
        # Its id is the nonce it answered (single use): a client whose Accept never came
        # knows it, and names it in a later release (``handshake.AcceptLost``).
        session = self.leases.open(
            name, hs.slots, now, private=hs.private, session_id=hs.nonce.hex()
        )
        if session is None:
            held = self.leases.held.blocks + self.shared.cache.held.blocks
            return self._reject(
                hs.seq,
                name,
                p.NO_FREE_SLOTS
                + (f" ({held} held for clients that may still write)" if held else ""),
            )
        self.counters["handshakes_accepted"] += 1
        session.identity = identity
        self._last_session = session
        if session.shared:
            session.namespace = hs.config_fingerprint
            self.shared.join(session)
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
            lease_start=session.lease.start,
            lease_stop=session.lease.stop,
            lease_timeout_s=self.leases.lease_timeout_s,
            shared=session.shared,
            max_granted=self.shared.cache.max_granted if session.shared else 0,
            **self._accept,
        )

    def _heartbeat(self, session: Session, hb: p.Heartbeat) -> p.ServerMessage:
        _count_bytes(session, hb)
        session.slots_used = min(max(hb.slots_used, 0), len(session.lease))
        return p.HeartbeatAck(hb.seq, self.shared.event_seq(session) if session.shared else -1)

    def _release(self, session_ids: list[str], now: float) -> None:
        """Earlier sessions whose client reported every write resolved: free what they held.
        A session this server still counts live (its client gave it up while this server was
        frozen or slow, before it expired here) ends now, clean: nothing of it is in flight.
        One not opened yet never will be: its client gave up waiting for the Accept, and the
        nonce its handshake answers is revoked."""
        if not session_ids:
            return
        self._gate.revoke(session_ids, now)
        for sid in session_ids:
            session = self.leases.sessions.get(sid)
            if session is not None:
                self.end(session, clean=True, why="released by its client, which moved on")
        freed = self.leases.release(session_ids) + self.shared.cache.release(session_ids)
        if freed:
            logger.info("released %d held slots of %d ended sessions", freed, len(session_ids))

    def _stats_request(self, req: p.StatsRequest, now: float) -> p.ServerMessage:
        known = self.leases.touch(req.session_id, now) is not None
        if self.config.token and not known:
            return p.Error(req.seq, p.UNKNOWN_SESSION)
        return _fitting(req.seq, self._server_stats())

    def _disconnect(self, session: Session, req: p.Disconnect) -> p.ServerMessage:
        _count_bytes(session, req)
        self._last_session = None  # ended: its ack has no session to end if undeliverable
        self.end(
            session,
            clean=req.clean,
            why=f"disconnected {'cleanly' if req.clean else 'with writes in flight'}",
        )
        return p.DisconnectAck(req.seq)


def _fitting(seq: int, stats: dict[str, Any]) -> p.StatsReply:
    """``stats`` as a reply that fits one frame (a larger one would cost the asking client its
    connection): the per-session list, then the per-namespace counts, cut short as needed;
    ``sessions_omitted``/``namespaces_omitted`` say how many were left out."""
    stats = {**stats, "sessions_omitted": 0, "namespaces_omitted": 0}
    size = len(p.encode(p.StatsReply(seq, stats)))
    for field in ("sessions", "namespaces"):
        while size > p.MAX_FRAME_BYTES and stats[field]:
            items = stats[field]
            kept = min(len(items) - 1, int(len(items) * 0.9 * p.MAX_FRAME_BYTES / size))
            if isinstance(items, dict):
                stats[field] = dict(list(items.items())[:kept])
            else:
                stats[field] = items[:kept]
            stats[f"{field}_omitted"] += len(items) - kept
            size = len(p.encode(p.StatsReply(seq, stats)))
    return p.StatsReply(seq, stats)


def _count_bytes(session: Session, report: p.Heartbeat | p.Disconnect) -> None:
    """Take a client's cumulative byte counts (they only grow; negative values are ignored)."""
    session.bytes_written = max(session.bytes_written, report.bytes_written)
    session.bytes_read = max(session.bytes_read, report.bytes_read)


def _span(lease: range) -> str:
    return f"[{lease.start}, {lease.stop})"
