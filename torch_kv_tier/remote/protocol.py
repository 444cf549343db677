"""Control-plane wire format between a tier (client) and ``torch-kv-tier serve`` (server).

Every message is one ZeroMQ frame holding one msgpack-encoded, tagged ``msgspec`` struct. The
client speaks through a DEALER socket, the server answers through a ROUTER socket. Every
request carries a ``seq`` that the answer echoes, so a late answer is never mistaken for the
answer to a newer request.

Conversation:

1. ``Hello(version, client_nonce)`` -> ``Challenge(version, nonce, server_proof)``, or
   ``Reject`` when the protocol versions differ.
2. ``Handshake(nonce, proof, agent_metadata, region, fingerprint, slots)`` -> ``Accept`` with
   the server's NIXL metadata, its whole region and the client's lease, or ``Reject(reason)``.
3. ``Heartbeat`` -> ``HeartbeatAck`` every heartbeat interval; ``StatsRequest`` ->
   ``StatsReply``; ``Disconnect`` -> ``DisconnectAck``. A request naming an unknown session is
   answered with ``Error(UNKNOWN_SESSION)``.

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

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # the largest frame either side accepts; NIXL metadata is ~1 KiB
NONCE_BYTES = 32
UNKNOWN_SESSION = "unknown session"
MEM_TYPES = ("DRAM", "VRAM")


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


class DisconnectAck(msgspec.Struct, tag="disconnect_ack"):
    seq: int


class Error(msgspec.Struct, tag="error"):
    seq: int
    reason: str


ClientMessage = Hello | Handshake | Heartbeat | StatsRequest | Disconnect
ServerMessage = Challenge | Accept | Reject | HeartbeatAck | StatsReply | DisconnectAck | Error

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)


class BadFrame(ValueError):
    """A frame that is too large, not msgpack, or not a known message; the text says which."""


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


def decode_client(frame: bytes) -> ClientMessage:
    """Parse a frame the server received; raise ``BadFrame`` saying what is wrong with it."""
    message: ClientMessage = _decode(_client_decoder, frame)
    return message


def decode_server(frame: bytes) -> ServerMessage:
    """Parse a frame the client received; raise ``BadFrame`` saying what is wrong with it."""
    message: ServerMessage = _decode(_server_decoder, frame)
    return message


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
