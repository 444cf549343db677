"""The server's half of the authenticated handshake (``handshake`` is the client's): the nonces a
``Hello`` is answered with, and every check a ``Handshake`` must pass before a session opens.

``Gate.hello`` answers a ``Hello`` with a ``Challenge``: a fresh nonce for that connection, and
the server's proof over both nonces when the server has a token. ``Gate.check`` takes the nonce
back (each is answered once, within ``CHALLENGE_TTL_S``) and checks the client's proof, its
region, block size, config fingerprint and arguments. What the server does with a session that
passed (a lease, a namespace) is the server's.

Failures: ``Refused`` carries the reason the client is told in a ``Reject``; a ``Hello`` that is
malformed raises ``protocol.BadFrame``. At most ``MAX_PENDING_CHALLENGES`` nonces wait at once
(the oldest are forgotten), so a flood of hellos costs bounded memory.

Threading: none of its own; the server calls it under its state lock, from its loop thread.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from torch_kv_tier.remote import protocol as p

CHALLENGE_TTL_S = 30.0  # a nonce must be answered within this time
MAX_PENDING_CHALLENGES = 1024  # oldest nonces are forgotten beyond this


class Refused(Exception):
    """A hello or handshake the server refuses; the message is what the client is told."""


@dataclass
class _Challenge:
    nonce: bytes
    client_nonce: bytes
    expires: float


class Gate:
    """The handshake's checks for a server with ``token`` (``None``: no authentication), blocks
    of ``block_len`` bytes and config ``fingerprint`` (``""``: any)."""

    def __init__(self, token: str | None, block_len: int, fingerprint: str) -> None:
        self._token = token
        self._block_len = block_len
        self._fingerprint = fingerprint
        self._challenges: dict[bytes, _Challenge] = {}  # connection identity -> its nonce

    def hello(self, identity: bytes, hello: p.Hello, now: float) -> p.Challenge:
        """A nonce for the connection ``identity`` (replacing one it was given before)."""
        if hello.version != p.PROTOCOL_VERSION:
            raise Refused(f"protocol version {hello.version} != {p.PROTOCOL_VERSION}")
        if not 16 <= len(hello.client_nonce) <= 64:
            raise p.BadFrame(f"client nonce must be 16..64 bytes, got {len(hello.client_nonce)}")
        nonce = secrets.token_bytes(p.NONCE_BYTES)
        challenges = self._challenges
        challenges.pop(identity, None)
        challenges[identity] = _Challenge(nonce, hello.client_nonce, now + CHALLENGE_TTL_S)
        while len(challenges) > MAX_PENDING_CHALLENGES:
            del challenges[next(iter(challenges))]
        token = self._token
        proof = p.server_proof(token, nonce, hello.client_nonce) if token else b""
        return p.Challenge(p.PROTOCOL_VERSION, hello.seq, nonce, proof)

    def check(self, identity: bytes, hs: p.Handshake, now: float) -> None:
        """Raise ``Refused`` unless ``hs`` answers the nonce ``identity`` was given and its
        client may open a session here. The nonce is used up either way."""
        challenge = self._challenges.pop(identity, None)
        if hs.version != p.PROTOCOL_VERSION:
            raise Refused(f"protocol version {hs.version} != {p.PROTOCOL_VERSION}")
        if challenge is None or challenge.expires < now or challenge.nonce != hs.nonce:
            raise Refused(p.STALE_NONCE)
        token = self._token
        if token and not p.proof_matches(
            p.client_proof(token, challenge.nonce, challenge.client_nonce), hs.proof
        ):
            raise Refused("bad token")
        problem = hs.region.problem()
        if problem is not None:
            raise Refused(problem)
        if hs.region.block_len != self._block_len:
            raise Refused(f"block_len {hs.region.block_len} != {self._block_len}")
        if len(hs.config_fingerprint) > p.MAX_FINGERPRINT:
            raise Refused(f"config fingerprint longer than {p.MAX_FINGERPRINT} characters")
        ours = self._fingerprint
        if ours and hs.config_fingerprint and ours != hs.config_fingerprint:
            raise Refused("config fingerprint mismatch")
        if hs.slots is not None and hs.slots <= 0:
            raise Refused(f"slots must be > 0, got {hs.slots}")
        if not hs.agent_metadata:
            raise Refused("agent metadata is empty")

    def revoke(self, session_ids: list[str]) -> None:
        """Forget the nonces of these (would-be) sessions: a session's id is the nonce its
        handshake answered, in hex, so a ``Handshake`` still on its way with one is refused."""
        ids = set(session_ids)
        challenges = self._challenges
        for identity in [i for i, c in challenges.items() if c.nonce.hex() in ids]:
            del challenges[identity]

    def expire(self, now: float) -> None:
        """Forget the nonces not answered in time."""
        challenges = self._challenges
        for identity in [i for i, c in challenges.items() if c.expires < now]:
            del challenges[identity]


__all__ = ["CHALLENGE_TTL_S", "MAX_PENDING_CHALLENGES", "Gate", "Refused"]
