"""Client side of the control plane: keep a session with a server alive, carry its requests,
disconnect; for a shared session also grants, commits, touches and the index events.

``RemoteSession.open`` performs the handshake in the caller's thread (``session_accept``), then a
background I/O thread owns the ZeroMQ socket: it sends heartbeats, carries requests made from
any thread (answers resolve futures on the I/O thread), batches commits and touches into as few
frames as each wake-up allows, and reports a lost session through ``on_lost``. A shared
session's pushed ``Events`` go to its ``IndexFollower`` (``follow``). The I/O thread is
``session_io``, how any thread hands it work ``session_handoff``; a shared session's requests
are ``shared_requests``.

Delivery: a control message is delivered or the session is lost, loudly. The session is lost
when the server stops answering heartbeats, says it no longer knows the session, the control
connection is reset (a NAT or load balancer dropping it; ZeroMQ would reconnect under a new
identity and frames in the old connection would be gone), or a frame cannot be queued. The
server then holds what the session may still write until the client releases it.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import zmq

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.connect_args import check_session_args, parse_address
from torch_kv_tier.remote.handshake import Cancel, HandshakeRejected, describe, end_unstarted
from torch_kv_tier.remote.protocol import Region
from torch_kv_tier.remote.replica import IndexFollower
from torch_kv_tier.remote.replies import Request
from torch_kv_tier.remote.session_accept import connect_accepted
from torch_kv_tier.remote.session_io import EndedByHost, callback_ref
from torch_kv_tier.remote.shared_requests import SharedRequests
from torch_kv_tier.tier_threads import TierThread

logger = logging.getLogger(__name__)

__all__ = ["HandshakeRejected", "Region", "RemoteSession", "parse_address"]

_DISCONNECT_TIMEOUT_S = 2.0


class RemoteSession(SharedRequests):
    """A session with a remote ``torch-kv-tier serve`` pool, kept alive by heartbeats.

    Attributes (read-only): ``peer_id`` (the server's stable host id, the same for every client
    and across its restarts at one address), ``session_id`` (this session's secret handle),
    ``agent_metadata`` (the server's NIXL metadata), ``base_addr``/``num_blocks``/
    ``block_len``/``mem_type`` (the server's whole region), ``shared`` (a shared session: slots
    come from ``grant``, keys are published with ``commit``), ``lease`` (a private session's
    slots; empty when shared), ``address``.

    Threading: every public method may be called from any thread. ``_lock`` guards the
    closed/lost flags, the usage counters, the batched commits and touches and the wake-up
    socket; the ZeroMQ socket belongs to the I/O thread alone once ``open`` returns.
    ``on_lost`` runs on the I/O thread, once; it may call ``close()``. A bound method
    ``on_lost`` is held weakly (its object usually owns the session: a strong reference would
    make a cycle that keeps the object, and its NIXL agent, alive until the garbage collector
    runs on some thread); once its object is gone it is not called.
    """

    def __init__(
        self,
        address: str,
        sock: zmq.Socket[bytes],
        monitor: zmq.Socket[bytes],
        accept: p.Accept,
        *,
        on_lost: Callable[[str], None] | None,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        timeout_s: float,
        release: list[str],
    ) -> None:
        self.address = address
        self.peer_id = accept.host_id or address
        self.session_id = accept.session_id
        self.public_id = accept.public_id
        self.agent_metadata = accept.agent_metadata
        self.region = accept.region
        self.base_addr = accept.region.base_addr
        self.num_blocks = accept.region.num_blocks
        self.block_len = accept.region.block_len
        self.mem_type = accept.region.mem_type
        self.lease = range(accept.lease_start, accept.lease_stop)
        self.shared = accept.shared
        self.max_granted = accept.max_granted  # 0: not announced (an older host)
        self._follower: IndexFollower | None = None
        self._on_lost = callback_ref(on_lost)
        # several heartbeats fit in both our loss timeout and the server's lease timeout
        self._interval_s = min(
            heartbeat_interval_s, heartbeat_timeout_s / 3, accept.lease_timeout_s / 3
        )
        self._hb_timeout_s = heartbeat_timeout_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._lost_reason: str | None = None
        self._io_done = False
        self._usage = {"bytes_written": 0, "bytes_read": 0, "slots_used": 0}
        self._requests: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._actions: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._commits: list[tuple[list[Any], list[int], list[int]]] = []
        self._commits_watched = False  # the I/O thread looks at the commits by their deadline
        self._riders: list[Request] = []  # requests that go out with the next commits
        self._flush = False  # send the riders (and the commits) at the next wake-up
        self._touches: list[Any] = []
        self._released: list[str] = []  # named in ``release``; read unless ``close`` was acked
        self._ended_clean = False  # the host answered a clean ``Disconnect``
        self._stopping = False  # tells the I/O thread to exit
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = TierThread(
            target=self._io_loop,
            args=(sock, monitor),
            name=f"tkvt-session-{accept.public_id}",
            daemon=True,
        )
        self.release(release)  # (queued before the I/O thread starts: it cannot fail)
        self._thread.start()

    @classmethod
    def open(
        cls,
        address: str,
        *,
        agent_metadata: bytes,
        region: Region,
        config_fingerprint: str = "",
        token: str | None = None,
        slots: int | None = None,
        on_lost: Callable[[str], None] | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        timeout_s: float = 10.0,
        client_name: str | None = None,
        private: bool = False,
        release: list[str] | None = None,
        cancel: Cancel | None = None,
    ) -> RemoteSession:
        """Handshake with the server at ``address`` (``HOST:PORT``): a shared session, or with
        ``private=True`` a lease of up to ``slots`` of its slots (``None``: as many as the
        server grants one client) that no other client sees. ``release`` names earlier
        sessions of this client whose writes all resolved: the server frees what it held for
        them (the first ``protocol.MAX_RELEASE`` with the handshake, any more in ``release``
        messages as the session starts). Setting ``cancel`` ends a handshake still waiting for
        the server's answer (a tier that closes; see ``handshake``).

        A heartbeat goes out every ``heartbeat_interval_s`` (at most a third of
        ``heartbeat_timeout_s`` and of the server's lease timeout); when the session is lost
        (module docstring) ``on_lost(peer_id)`` is called once, on the session's I/O thread.

        Raises ``ValueError`` for bad arguments (before any network traffic; ``timeout_s`` is
        at least 0.1 s, ``heartbeat_timeout_s`` 1 s, ``heartbeat_interval_s`` 0.01 s, each
        floor's message saying why: ``connect_args.FLOORS``),
        ``HandshakeRejected`` when the server refuses (or cannot prove it knows ``token``),
        ``host_names.UnresolvedHost`` (a ``ConnectionError``) at once when the host's name
        does not resolve (not looked up: an IP address), or not within ``timeout_s``,
        ``TimeoutError`` when no server answers within ``timeout_s`` (``AcceptLost`` once the
        handshake went out), ``ConnectionError`` when the server answers with an error, accepts
        with a lease or region no session can use (it is told to end that session) or
        ``cancel`` was set (``AcceptAbandoned`` once the handshake went out); the sessions the
        server may have opened meanwhile are ``handshake_errors.opened_by`` the error,
        ``OSError``/``RuntimeError`` when the session cannot start here once accepted (no file
        descriptor or thread left: the server is told to end it).
        """
        slots = check_session_args(
            address,
            region,
            agent_metadata,
            slots,
            private,
            token,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            timeout_s=timeout_s,
        )
        # as the floats every wait takes (a numpy.float32 reaches none)
        timeout_s, heartbeat_timeout_s = float(timeout_s), float(heartbeat_timeout_s)
        heartbeat_interval_s = float(heartbeat_interval_s)
        release = list(release or ())
        hello = p.Handshake(
            version=p.PROTOCOL_VERSION,
            seq=2,
            nonce=b"",
            proof=b"",
            agent_metadata=bytes(agent_metadata),
            region=region,
            config_fingerprint=config_fingerprint,
            slots=slots,
            client_name=client_name or f"{socket.gethostname()}:{os.getpid()}",
            private=private,
            release=release[: p.MAX_RELEASE],
        )
        sock, monitor, accept, opened = connect_accepted(address, hello, token, timeout_s, cancel)
        try:
            session = cls(
                address,
                sock,
                monitor,
                accept,
                on_lost=on_lost,
                heartbeat_interval_s=heartbeat_interval_s,
                heartbeat_timeout_s=heartbeat_timeout_s,
                timeout_s=timeout_s,
                release=[*release[p.MAX_RELEASE :], *opened],
            )
        except BaseException:  # (no file descriptor or thread left): no I/O thread owns them
            end_unstarted(sock, monitor, accept.session_id)
            raise
        logger.info(
            "connected to %s (session %s): %s of %d slots",
            session.peer_id,
            session.public_id,
            "shared pool" if session.shared else f"private lease {session.lease}",
            session.num_blocks,
        )
        return session

    # -- public -----------------------------------------------------------------------------

    @property
    def lost(self) -> str | None:
        """Why the session was lost (server silent, lease expired), or ``None`` while alive."""
        with self._lock:
            return self._lost_reason

    def report_usage(
        self, *, written: int = 0, read: int = 0, slots_used: int | None = None
    ) -> None:
        """Add bytes moved to/from the server's pool and set the leased slots in use; sent
        with the next heartbeat (and the disconnect) so the server's stats and metrics show
        them. Thread-safe."""
        if written < 0 or read < 0:
            raise ValueError(f"byte counts must be >= 0, got written={written} read={read}")
        with self._lock:
            self._usage["bytes_written"] += written
            self._usage["bytes_read"] += read
            if slots_used is not None:
                self._usage["slots_used"] = slots_used

    def release(self, held: list[str]) -> None:
        """Tell the server that every write of the earlier sessions ``held`` resolved. Until
        this session's disconnect is answered they are ``unreleased``: a control connection
        reset (or a session lost) may lose them in flight."""
        for i in range(0, len(held), p.MAX_RELEASE):
            chunk = held[i : i + p.MAX_RELEASE]
            self._post(partial(p.Release, session_id=self.session_id, held=chunk))
            with self._lock:
                self._released += chunk

    def unreleased(self) -> list[str]:
        """The sessions ``release`` named that the server may not have read: every one, unless
        ``close`` got the answer to its disconnect (the server reads in order). A session that
        ended otherwise (lost, reset, its disconnect unanswered) leaves them to be named again:
        a server that read them, or restarted since, ignores them. A clean ``close`` the server
        no longer knew (``EndedByHost``: its lease expired, held until named) adds this one."""
        with self._lock:
            return list(self._released)

    @property
    def ended_clean(self) -> bool:
        """Whether the host answered this session's clean ``Disconnect``: it ended the session
        and holds nothing of it (there is nothing to ``release``)."""
        with self._lock:
            return self._ended_clean

    def stats(self) -> dict[str, Any]:
        """The server's stats: leases, occupancy, bytes moved, counters. A host with more
        sessions or namespaces than one frame holds cuts their lists short
        (``sessions_omitted``/``namespaces_omitted`` say by how many).

        Raises ``TimeoutError`` when the server does not answer within ``timeout_s``,
        ``ConnectionError`` when the session is closed or lost, and ``RuntimeError`` on the
        session's I/O thread (a callback: the answer would come on the thread it blocks).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"stats() of {self.peer_id} waits for an answer that the session's I/O thread "
                "receives: call it from another thread, not from a callback"
            )
        asked = self._call_async(lambda seq: p.StatsRequest(seq, self.session_id))
        reply = asked.result(timeout=self._timeout_s + 5.0)  # the I/O thread times it out
        if isinstance(reply, p.StatsReply):
            return reply.stats
        raise ConnectionError(f"{self.peer_id} refused stats: {describe(reply)}")

    def close(self, *, clean: bool = True) -> None:
        """End the session (a disconnect), stop the I/O thread. Pass ``clean=False`` while a
        write to the server may still be in flight: the server then holds the session's slots
        until ``release``. Idempotent; never raises for a lost server.

        The I/O thread closes the connection only once the server answered the disconnect (and
        so every request before it), or ~2 s passed: a connection closed sooner can make the
        server drop the disconnect, or end the session as if its writes could still land (it
        cannot answer a request it reads after the close), holding its slots. Past that bound
        the server ends the session by its own rules (its lease timeout). ``close`` waits for
        this; on the I/O thread (a callback) it returns at once and the thread stops when the
        answer comes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            alive = self._lost_reason is None
            written, read = self._usage["bytes_written"], self._usage["bytes_read"]
        bye = partial(p.Disconnect, session_id=self.session_id, clean=clean)
        bye = partial(bye, bytes_written=written, bytes_read=read)
        timeout_s = min(self._timeout_s, _DISCONNECT_TIMEOUT_S)
        if alive:
            try:
                said_bye = partial(self._said_bye, clean)
                self._call_async(bye, said_bye, timeout_s, allow_closed=True)
            except ConnectionError:  # lost meanwhile: there is nobody to tell
                alive = False
        if not alive:
            self._stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s + self._timeout_s)
            if self._thread.is_alive():
                frame = sys._current_frames().get(self._thread.ident or -1)
                logger.error(
                    "I/O thread of %s did not stop within %.1f s; it is at:\n%s",
                    self.peer_id,
                    timeout_s + self._timeout_s,
                    "".join(traceback.format_stack(frame)) if frame else "(ended meanwhile)",
                )
        logger.info("closed session %s of %s", self.public_id, self.peer_id)

    def _said_bye(self, clean: bool, answer: Future[p.ServerMessage]) -> None:
        """(I/O thread.) The disconnect (``clean`` or not) was answered, timed out or failed:
        stop the thread. A host that no longer knows the session (``EndedByHost``) ended it
        already: said at info (the sessions it released are named again all the same)."""
        try:
            reply = answer.result()
        except EndedByHost as exc:  # (e.g. named resolved by ``close``'s last word meanwhile)
            logger.info("disconnect from %s: the host had ended it already: %s", self.peer_id, exc)
            if clean:  # its lease expired, maybe: held until named (``unreleased``)
                with self._lock:
                    self._released.append(self.session_id)
        except (TimeoutError, ConnectionError) as exc:
            logger.warning("disconnect from %s got no answer: %s", self.peer_id, exc)
        else:
            if not isinstance(reply, p.DisconnectAck):
                logger.warning("disconnect from %s: %s", self.peer_id, describe(reply))
            else:  # read after every release this session carried
                with self._lock:
                    self._released.clear()
                    self._ended_clean = clean
        self._stop()

    def _stop(self) -> None:
        """Tell the I/O thread to end once what was queued went out."""
        with self._lock:
            self._stopping = True
        self._wake()

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteSession({self.peer_id!r}, {self.public_id}, lease={self.lease})"
