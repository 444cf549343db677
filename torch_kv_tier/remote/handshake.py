"""The client's first steps with a server: the control socket and the authenticated handshake.

``connect`` makes the DEALER socket (with a monitor that reports a reset connection:
``disconnected``; ``close_sockets`` closes both) and ``handshake`` runs
``Hello``/``Challenge``/``Handshake``/``Accept`` on it, in the caller's thread, before any I/O
thread exists (``connect_args.check_session_args`` first refuses bad arguments). See
``protocol`` for the conversation and the proofs. A handshake waits for the server's first
answer until its deadline, or until its ``cancel`` event is set (looked at every
``CANCEL_POLL_S``): a tier that closes does not wait out a host that does not answer. Once the
``Handshake`` is sent the server may have opened the session (the server names a session by the
nonce it answered). Without an ``Accept`` by the deadline, the handshake raises ``AcceptLost``
with the session's id, which the client names in its next handshake's ``release`` to that
server: the server then ends the session, clean (nothing was written through it), or refuses
the ``Handshake`` if it has not arrived yet. A ``cancel`` set while the ``Accept`` is awaited
abandons it at once (``AcceptAbandoned``, with the same id to release): a clean ``Disconnect``
of the session follows the ``Handshake`` on the same connection, for the server to end the
session as soon as it opened it. A control connection closed while an answer is awaited (the
host killed and started again on its port, or the connection reset) is greeted again at once,
over the connection ZeroMQ makes anew: its answer would never come. The session the lost
``Handshake`` may have opened (on a host still running) is named in the next ``Handshake``'s
``release`` (past ``MAX_RELEASE``, in ``release`` after the new one's ``Accept``), and with the
handshake's failure (``opened_by``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.connect_args import parse_address
from torch_kv_tier.remote.handshake_errors import (
    NO_PROOF,
    AcceptAbandoned,
    AcceptLost,
    Cancelled,
    Closed,
    HandshakeRejected,
    naming,
)

logger = logging.getLogger(__name__)

SNDHWM = 1000  # control frames queued to the server before the session counts as failed
CANCEL_POLL_S = 0.05  # how often a handshake waiting for an answer looks at its cancel event
LINGER_MS = 1000  # how long a closed session's last frames may take to go out
GREETINGS = 3  # hellos one handshake may say: more after a nonce refused as stale


class Cancel(Protocol):
    """What a handshake looks at while it awaits an answer: it gives up once set (a
    ``threading.Event``, or anything with its ``is_set``)."""

    def is_set(self) -> bool: ...


def dealer(address: str) -> tuple[zmq.Socket[bytes], str]:
    """A DEALER socket for the server at ``address``, not connected yet, and the endpoint to
    connect it to. The caller closes it. Raises ``ValueError`` for a bad address,
    ``zmq.ZMQError`` when no socket can be made (no file descriptor left)."""
    host, port = parse_address(address)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    return sock, f"tcp://{host}:{port}"


def connect(address: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A DEALER socket connecting to ``address`` and its monitor (disconnect events), made
    before the connection so that no event is missed. The caller closes both."""
    sock, endpoint = dealer(address)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        close_sockets(sock, monitor)
        raise ValueError(f"server address {address!r}: ZeroMQ refused it ({exc})") from None
    return sock, monitor


def disconnected(monitor: zmq.Socket[bytes]) -> bool:
    """Whether ``connect``'s monitor reports the control connection closed (or reset)."""
    while monitor.poll(0, zmq.POLLIN):
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def close_sockets(
    sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], *, linger: bool = False
) -> None:
    """Close what ``connect`` made; ``linger``: frames sent but not yet out still go, for up
    to ``LINGER_MS`` (a ``Disconnect`` sent last), else they are dropped."""
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=LINGER_MS if linger else 0)


def accept_problem(accept: p.Accept) -> str | None:
    """Why a session cannot use ``accept`` (a host with a bug, or of another version), or
    ``None``: its region, its lease (within the region), its lease timeout (finite, > 0:
    the heartbeat interval is a third of it) and its cap on granted slots (>= 0; 0: none
    announced)."""
    problem = accept.region.problem()
    if problem is not None:
        return problem
    if not 0 <= accept.lease_start <= accept.lease_stop <= accept.region.num_blocks:
        return (
            f"lease [{accept.lease_start}, {accept.lease_stop}) outside its "
            f"{accept.region.num_blocks} slots"
        )
    if not 0 < accept.lease_timeout_s < math.inf:
        return f"lease timeout {accept.lease_timeout_s} s, not a finite number > 0"
    if accept.max_granted < 0:
        return f"max granted {accept.max_granted} slots, below 0"
    return None


def end_unstarted(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], session_id: str) -> None:
    """End a session the server accepted that could not start here: a clean ``Disconnect``
    (nothing was written through it), then close what ``connect`` made, letting it go out."""
    with contextlib.suppress(zmq.ZMQError):
        sock.send(p.encode(p.Disconnect(3, session_id, clean=True)), zmq.NOBLOCK)
    close_sockets(sock, monitor, linger=True)


def handshake(
    sock: zmq.Socket[bytes],
    address: str,
    deadline: float,
    token: str | None,
    request: p.Handshake,
    cancel: Cancel | None = None,
    monitor: zmq.Socket[bytes] | None = None,
    opened: list[str] | None = None,
) -> p.Accept:
    """Authenticate both ways and open a session; raises ``HandshakeRejected`` (also when
    the server could not decode the ``Hello`` or ``Handshake``: a version skew or a bug, which
    no retry of the same request mends; no session was opened),
    ``TimeoutError`` (nothing answered by ``deadline``; ``AcceptLost`` once the ``Handshake``
    went out) or ``ConnectionError`` (the server answered with an error, or ``cancel`` was set:
    ``AcceptAbandoned`` once the ``Handshake`` went out).

    It starts again with a ``Hello``, up to ``GREETINGS`` times in all, within ``deadline``:
    after a ``Handshake`` refused for its nonce (``protocol.STALE_NONCE``: it reached a server
    restarted since its ``Hello``, or the same one over a connection that was reset and came
    back under a new identity; no refusal of this client), first taking from ``connect``'s
    ``monitor`` the disconnects of the connection that was replaced (none of the session's);
    and as soon as ``monitor`` reports the connection closed while an answer is awaited (the
    host killed and started again, or the connection reset: the answer would never come).
    The sessions the ``Handshake``s of closed connections may have opened are named in the
    next ``Handshake``'s ``release`` while it has room (the host frees them before it weighs
    that one: else a host at its ``--max-sessions``, or with no free slot, refused it for the
    session its own lost ``Accept`` opened); the others are appended to ``opened`` once an
    ``Accept`` came (the caller releases them over the new session). A failed handshake names
    them all (``opened_by``)."""
    greetings, lost = 1, []
    while True:
        try:
            watched = monitor if greetings < GREETINGS else None
            accept = _greet(sock, address, deadline, token, request, cancel, watched, greetings)
        except Closed as exc:
            if exc.session_id is not None:
                lost.append(exc.session_id)
                if len(request.release) < p.MAX_RELEASE:  # freed before the host weighs the next
                    request.release.append(exc.session_id)
            logger.info("%s: control connection closed amid the handshake: greeting again", address)
        except Exception as exc:
            stale = isinstance(exc, HandshakeRejected) and exc.reason == p.STALE_NONCE
            if not stale or greetings == GREETINGS:
                failure = naming(exc, address, lost)
                if failure is exc:
                    raise
                raise failure from exc
            logger.info("%s refused the handshake's nonce as stale: greeting it again", address)
            if monitor is not None:
                disconnected(monitor)
        else:
            if opened is not None:
                opened += [session_id for session_id in lost if session_id not in request.release]
            return accept
        greetings += 1


def say_hello(sock: zmq.Socket[bytes], flags: int = 0, seq: int = 1) -> bytes:
    """Send a handshake's first frame, a ``Hello`` numbered ``seq`` with a fresh nonce, on
    ``sock``; return the nonce (the client's half of the proofs). ``flags``: ``zmq.NOBLOCK``
    raises ``zmq.Again`` rather than waiting for room to send."""
    client_nonce = secrets.token_bytes(p.NONCE_BYTES)
    sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, seq, client_nonce)), flags)
    return client_nonce


def _greet(
    sock: zmq.Socket[bytes],
    address: str,
    deadline: float,
    token: str | None,
    request: p.Handshake,
    cancel: Cancel | None,
    monitor: zmq.Socket[bytes] | None,
    greeting: int,
) -> p.Accept:
    """One ``Hello``/``Challenge``/``Handshake``/``Accept`` (``handshake``), the ``greeting``-th
    (from 1); ``Closed`` once ``monitor`` reports the connection closed while an answer is
    awaited. Its ``Hello`` is numbered ``2 * greeting - 1``, its ``Handshake`` ``2 * greeting``
    (the server echoes them): a late answer to an earlier greeting's (a ``Hello`` that reached
    a restarted host along with this one) is skipped, never taken for this one's."""
    client_nonce = say_hello(sock, seq=2 * greeting - 1)
    challenge = _expect(sock, address, 2 * greeting - 1, deadline, p.Challenge, cancel, monitor)
    if challenge.version != p.PROTOCOL_VERSION:
        raise HandshakeRejected(
            address, f"protocol version {p.PROTOCOL_VERSION} != {challenge.version}"
        )
    request.nonce = challenge.nonce
    request.client_nonce = client_nonce
    if token is not None:
        request.proof = p.client_proof(token, challenge.nonce, client_nonce)
    request.seq = 2 * greeting
    sock.send(p.encode(request))
    session_id = challenge.nonce.hex()  # the session the server may open (module docstring)
    try:
        accept: p.Accept = _expect(sock, address, request.seq, deadline, p.Accept, cancel, monitor)
    except Closed:
        raise Closed(session_id) from None
    except Cancelled:
        with contextlib.suppress(zmq.ZMQError):
            sock.send(p.encode(p.Disconnect(3, session_id, clean=True)), zmq.NOBLOCK)
        raise AcceptAbandoned(address, session_id) from None
    except TimeoutError:
        raise AcceptLost(address, session_id) from None
    # checked last so that a wrong token gets the server's "bad token"; an honest server that
    # accepted our proof knows the token, so a mismatch here means an impostor (or no token)
    if token is not None and not p.proof_matches(
        p.server_proof(token, challenge.nonce, client_nonce), challenge.server_proof
    ):
        sock.send(p.encode(p.Disconnect(3, accept.session_id, clean=True)))
        raise HandshakeRejected(address, NO_PROOF)
    return accept


def no_answer(address: str, timeout_s: float | None = None) -> TimeoutError:
    """The error of a host at ``address`` that did not answer (a handshake, or ``answering``'s
    greeting within ``timeout_s``), saying what to check."""
    within = "" if timeout_s is None else f" within {timeout_s} s"
    return TimeoutError(
        f"no answer from a torch-kv-tier server at {address}{within}: is `torch-kv-tier serve` "
        "running there, and is the address reachable from this host?"
    )


def describe(message: p.ServerMessage) -> str:
    """A server answer that was not the one expected, in words."""
    if isinstance(message, p.Error | p.Reject):
        return message.reason
    return f"unexpected {type(message).__name__}"


def _await_reply(
    sock: zmq.Socket[bytes],
    seq: int,
    deadline: float,
    cancel: Cancel | None,
    monitor: zmq.Socket[bytes] | None,
) -> p.ServerMessage | None:
    """The reply to request ``seq``, or ``None`` at ``deadline`` or once ``cancel`` is set;
    other frames are skipped. An ``Error`` with seq 0 is the server's answer to a frame it
    could not decode: during a handshake the one request outstanding, so it is the reply.
    Raises ``Closed`` once ``monitor`` reports the connection closed, after every frame
    received before."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if monitor is not None:
        poller.register(monitor, zmq.POLLIN)
    while (left := deadline - time.monotonic()) > 0:
        if cancel is not None:
            if cancel.is_set():
                return None
            left = min(left, CANCEL_POLL_S)
        ready = dict(poller.poll(math.ceil(left * 1e3)))
        if sock not in ready:
            if monitor in ready and monitor is not None and disconnected(monitor):
                return _received(sock, seq)
            continue
        message = _reply(sock, seq)
        if message is not None:
            return message
    return None


def _reply(sock: zmq.Socket[bytes], seq: int) -> p.ServerMessage | None:
    """The next frame on ``sock`` if it is the reply to request ``seq`` (``_await_reply``),
    else ``None``: it is skipped (as is a frame that cannot be decoded, or none there)."""
    try:
        message = p.decode_server(sock.recv(zmq.NOBLOCK))
    except (zmq.Again, p.BadFrame) as exc:
        logger.debug("skipping control frame: %s", exc)
        return None
    if message.seq == seq or (isinstance(message, p.Error) and message.seq == 0):
        return message
    return None


def _received(sock: zmq.Socket[bytes], seq: int) -> p.ServerMessage:
    """The reply to request ``seq`` among the frames ``sock`` received before its connection
    closed; raises ``Closed`` when it is not among them. One poll can see the monitor's
    disconnect and not a frame that arrived just before it (it looks at ``sock`` first):
    ZeroMQ queued that frame before it reported the disconnect, so ``sock`` has it now."""
    while sock.poll(0, zmq.POLLIN):
        message = _reply(sock, seq)
        if message is not None:
            return message
    raise Closed(None)


def _expect(
    sock: zmq.Socket[bytes],
    address: str,
    seq: int,
    deadline: float,
    kind: type[Any],
    cancel: Cancel | None,
    monitor: zmq.Socket[bytes] | None,
) -> Any:
    reply = _await_reply(sock, seq, deadline, cancel, monitor)
    if reply is None and cancel is not None and cancel.is_set():
        raise Cancelled(
            f"handshake with {address} cancelled: the tier is closing, or no longer dials it"
        )
    if reply is None:
        raise no_answer(address)
    if isinstance(reply, p.Reject) or (isinstance(reply, p.Error) and reply.seq == 0):
        raise HandshakeRejected(address, reply.reason)
    if not isinstance(reply, kind):
        raise ConnectionError(f"server at {address} answered the handshake: {describe(reply)}")
    return reply
