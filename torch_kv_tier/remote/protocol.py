"""Control-plane wire format between a tier (client) and ``torch-kv-tier serve`` (server).

Every message is one ZeroMQ frame holding one msgpack-encoded, tagged ``msgspec`` struct. The
client speaks through a DEALER socket, the server answers through a ROUTER socket. Every
request carries a ``seq`` that the answer echoes, so a late answer is never mistaken for the
answer to a newer request.

Conversation:

1. ``Hello(version, client_nonce)`` -> ``Challenge(version, nonce, server_proof)``, or
   ``Reject`` when the protocol versions differ.
2. ``Handshake(nonce, client_nonce, proof, agent_metadata, region, fingerprint, slots,
   private)`` (the client nonce of its ``Hello`` again: the server keeps nothing per hello) ->
   ``Accept`` with the server's NIXL metadata, its whole region and its stable ``host_id`` (what
   every tier places keys by), or ``Reject(reason)``. A private session gets a lease
   (``lease_start``/``lease_stop``) that it manages alone; a shared session (the default) gets
   none and works through the messages of step 4. ``release`` names earlier sessions of this
   client whose writes have all resolved (see step 5). A session's id is the nonce its
   ``Handshake`` answered, in hex: a client whose ``Accept`` never came knows it all the same,
   and releases it.
3. ``Heartbeat`` -> ``HeartbeatAck`` every heartbeat interval (for a shared session it carries
   the namespace's last ``event_seq``, so a client that missed pushed events notices);
   ``StatsRequest`` -> ``StatsReply``; ``Disconnect(clean)`` -> ``DisconnectAck``. A request
   naming an unknown session is answered with ``Error(UNKNOWN_SESSION)``.
4. Shared sessions (keys are namespaced by the session's config fingerprint):
   ``GrantRequest(want)`` -> ``Granted(slots)``: free slots only this session may write;
   ``Commit(keys, slots, digests)`` (no answer): those writes completed, publish the keys with
   the digests of their bytes; ``Touch(keys)`` (no answer): recency;
   ``SnapshotRequest(cursor)`` -> ``SnapshotPage``: the namespace's stored keys with their
   slots and digests, in pages. The server pushes ``Events(event_seq, stored, slots, digests,
   evicted)`` (``seq`` 0) to every shared session of the namespace; a gap in ``event_seq``
   means events were lost, and the client takes a new snapshot. A client reads a stored key's
   slot straight from its copy and checks the bytes against the digest: a stale copy costs a
   miss, never wrong bytes. A host with a disk tier (``serve --disk``) announces a key held
   only on its disk as stored in slot ``ON_DISK`` (digest 0); ``Promote(keys)`` (no answer)
   asks it to bring such keys back into DRAM slots, which it then announces as stored there.
5. Fencing: a session that ends without a clean ``Disconnect`` (expired, or writes still in
   flight) may still write its slots, so the server holds them (its private lease, or its
   uncommitted grants) until the client names it in ``Release(held)`` (no answer) or in a later
   ``Handshake.release``, once the transport reported every write of it resolved.

Delivery: a message is delivered or its session ends. The server ends a session whose answer
or push it cannot queue (and holds its slots); the client treats a reset control connection or
a full send queue as a lost session.

Authentication: the token never crosses the wire. The client proves it knows the token with an
HMAC over the server's single-use nonce, the server proves it with an HMAC over the client's
nonce (see ``client_proof`` / ``server_proof``).

Compatibility rule: ``Hello`` and ``Reject`` keep their fields in every protocol version, so
peers of different versions can always tell each other why they cannot talk.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import msgspec

from torch_kv_tier.keys import limits_problem

PROTOCOL_VERSION = 5
MAX_FRAME_BYTES = 1 << 20  # the largest frame either side accepts; NIXL metadata is ~1 KiB
NONCE_BYTES = 32
ON_DISK = -1  # the slot of a key a shared host holds only on its disk (``Promote`` it)
UNKNOWN_SESSION = "unknown session"
# a ``Handshake`` whose nonce this server never gave its connection (restarted, or the
# connection was reset and came back under a new identity) or gave too long ago: say hello again
STALE_NONCE = "stale or unknown nonce: start again with hello"
# how a host's refusals of its state now, not of the request, start (the first two) or end: the
# same ``Handshake`` may be accepted later (``HandshakeRejected.busy``)
NO_FREE_SLOTS = "no free slots"
TOO_MANY_SESSIONS = "too many sessions"
TRY_AGAIN_LATER = "try again later"
MEM_TYPES = ("DRAM", "VRAM")
MAX_KEYS_PER_MESSAGE = 8192  # keeps every frame below MAX_FRAME_BYTES (keys <= MAX_KEY_BYTES)
MAX_FINGERPRINT = 64  # characters of a config fingerprint (ours are 16 hex digits)
MAX_RELEASE = 64  # earlier sessions one message may release

# A shared key on the wire: bytes, str or a 64-bit int. msgspec cannot decode a union of bytes
# and str, so keys decode as Any (msgpack keeps the three apart) and the server checks them.
WireKey = Any


@dataclass(frozen=True)
class Region:
    """A block region as the other side sees it: where it is and how it is cut into blocks."""

    base_addr: int
    num_blocks: int
    block_len: int
    mem_type: str = "DRAM"

    def problem(self) -> str | None:
        """Why this region cannot be used, or ``None`` when it is well formed."""
        if self.num_blocks <= 0 or self.block_len <= 0:
            return f"region must have num_blocks > 0 and block_len > 0, got {self}"
        if self.base_addr < 0:
            return f"region base_addr must be >= 0, got {self.base_addr}"
        if self.mem_type not in MEM_TYPES:
            return f"region mem_type must be one of {MEM_TYPES}, got {self.mem_type!r}"
        return None


class Hello(msgspec.Struct, tag="hello"):
    version: int
    seq: int
    client_nonce: bytes


class Challenge(msgspec.Struct, tag="challenge"):
    version: int
    seq: int
    nonce: bytes
    server_proof: bytes  # empty when the server has no token


class Handshake(msgspec.Struct, tag="handshake"):
    version: int
    seq: int
    nonce: bytes
    proof: bytes  # empty when the client has no token
    agent_metadata: bytes
    region: Region
    config_fingerprint: str
    slots: int | None
    client_name: str = ""
    private: bool = False
    release: list[str] = []  # earlier sessions of this client whose writes all resolved
    client_nonce: bytes = b""  # its ``Hello``'s, which the server's ``nonce`` was made for


class Accept(msgspec.Struct, tag="accept"):
    seq: int
    session_id: str
    public_id: str
    server_name: str
    agent_metadata: bytes
    region: Region
    lease_start: int
    lease_stop: int
    lease_timeout_s: float
    shared: bool = False
    host_id: str = ""  # stable across restarts at the same address: what keys are placed by
    max_granted: int = 0  # shared: the most slots a session may hold granted, uncommitted


class Reject(msgspec.Struct, tag="reject"):
    seq: int
    reason: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    seq: int
    session_id: str
    bytes_written: int = 0  # cumulative, as reported by the client
    bytes_read: int = 0
    slots_used: int = 0


class HeartbeatAck(msgspec.Struct, tag="heartbeat_ack"):
    seq: int
    event_seq: int = -1  # a shared session's namespace: the last event batch pushed


class StatsRequest(msgspec.Struct, tag="stats"):
    seq: int
    session_id: str = ""


class StatsReply(msgspec.Struct, tag="stats_reply"):
    seq: int
    stats: dict[str, Any]


class Disconnect(msgspec.Struct, tag="disconnect"):
    seq: int
    session_id: str
    bytes_written: int = 0  # final cumulative counts, as in ``Heartbeat``
    bytes_read: int = 0
    clean: bool = False  # no write of this session is in flight: its slots are free at once


class DisconnectAck(msgspec.Struct, tag="disconnect_ack"):
    seq: int


class Error(msgspec.Struct, tag="error"):
    seq: int
    reason: str


class GrantRequest(msgspec.Struct, tag="grant"):
    seq: int
    session_id: str
    want: int


class Granted(msgspec.Struct, tag="granted"):
    seq: int
    slots: list[int]


class Commit(msgspec.Struct, tag="commit"):
    seq: int
    session_id: str
    keys: list[WireKey]
    slots: list[int]
    digests: list[int]  # per key: ``digest.block_digest`` of the bytes written


class Release(msgspec.Struct, tag="release"):
    seq: int
    session_id: str
    held: list[str]  # earlier sessions of this client whose writes all resolved


class Touch(msgspec.Struct, tag="touch"):
    seq: int
    session_id: str
    keys: list[WireKey]


class Promote(msgspec.Struct, tag="promote"):
    seq: int
    session_id: str
    keys: list[WireKey]  # keys announced in slot ``ON_DISK``: bring them into DRAM slots


class SnapshotRequest(msgspec.Struct, tag="snapshot"):
    seq: int
    session_id: str
    cursor: int = 0


class SnapshotPage(msgspec.Struct, tag="snapshot_page"):
    seq: int
    keys: list[WireKey]
    slots: list[int]
    digests: list[int]
    event_seq: int  # the namespace's event sequence number the snapshot was taken at
    next_cursor: int  # -1 after the last page


class Events(msgspec.Struct, tag="events"):
    seq: int  # always 0: pushed, not an answer
    event_seq: int
    stored: list[WireKey]
    slots: list[int]  # of each stored key
    digests: list[int]  # of each stored key
    evicted: list[WireKey]


ClientMessage = (
    Hello
    | Handshake
    | Heartbeat
    | StatsRequest
    | Disconnect
    | GrantRequest
    | Commit
    | Release
    | Touch
    | Promote
    | SnapshotRequest
)
ServerMessage = (
    Challenge
    | Accept
    | Reject
    | HeartbeatAck
    | StatsReply
    | DisconnectAck
    | Error
    | Granted
    | SnapshotPage
    | Events
)

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)


class BadFrame(ValueError):
    """A frame that is too large, not msgpack, nested too deeply, or not a known message; the
    text says which."""


def encode(message: ClientMessage | ServerMessage) -> bytes:
    """One frame for ``message``."""
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes) -> Any:
    if len(frame) > MAX_FRAME_BYTES:
        raise BadFrame(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise BadFrame(f"malformed frame: {exc}") from None
    except RecursionError:  # a key field (``Any``) nested thousands deep: a few KiB do it
        raise BadFrame("malformed frame: nested too deeply") from None


def decode_client(frame: bytes) -> ClientMessage:
    """Parse a frame the server received; raise ``BadFrame`` saying what is wrong with it."""
    message: ClientMessage = _decode(_client_decoder, frame)
    return message


def decode_server(frame: bytes) -> ServerMessage:
    """Parse a frame the client received; raise ``BadFrame`` saying what is wrong with it."""
    message: ServerMessage = _decode(_server_decoder, frame)
    return message


def bad_keys(keys: list[Any]) -> str | None:
    """Why a list of keys received from a client cannot be used, or ``None`` (a client checks
    its keys at the API; this keeps a buggy or hostile one from growing the server's frames)."""
    if len(keys) > MAX_KEYS_PER_MESSAGE:
        return f"at most {MAX_KEYS_PER_MESSAGE} keys per message, got {len(keys)}"
    types = set(map(type, keys))
    if not _WIRE_KEY_TYPES.issuperset(types):
        return "keys must be bytes, str or int"
    return limits_problem(keys, types)


_WIRE_KEY_TYPES = frozenset({bytes, str, int})


def client_proof(token: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """What a client that knows ``token`` sends: HMAC-SHA256 over both nonces."""
    return _mac(token, b"torch-kv-tier client\x00" + nonce + client_nonce)


def server_proof(token: str, nonce: bytes, client_nonce: bytes) -> bytes:
    """What a server that knows ``token`` sends back; distinct from ``client_proof``."""
    return _mac(token, b"torch-kv-tier server\x00" + client_nonce + nonce)


def proof_matches(expected: bytes, given: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, given)


def _mac(token: str, message: bytes) -> bytes:
    return hmac.new(token.encode(), message, hashlib.sha256).digest()
