"""The server's half of the authenticated handshake (``handshake`` is the client's): the nonces a
``Hello`` is answered with, and every check a ``Handshake`` must pass before a session opens.

``Gate.hello`` answers a ``Hello`` with a ``Challenge``: a nonce for that connection, and the
server's proof over both nonces when the server has a token. The gate keeps nothing per hello:
the nonce carries its expiry, a random part and a MAC under a secret of this process over the
connection's identity, the client's nonce (the ``Handshake`` carries it back), the expiry and
the random part. ``Gate.check`` recomputes that MAC, so a flood of hellos (from any number of
connections) costs no memory and pushes out no other client's pending handshake. A nonce opens
at most one session, within ``CHALLENGE_TTL_S``: the first ``Handshake`` whose proof passes uses
it up (whatever the later checks say) and the gate remembers it until it would have expired
anyway; one refused for its proof uses nothing, so a flood of bad proofs fills nothing either.
``check`` then checks the client's region, block size, config fingerprint and arguments. What
the server does with a session that passed (a lease, a namespace) is the server's.

Failures: ``Refused`` carries the reason the client is told in a ``Reject``; a ``Hello`` that is
malformed raises ``protocol.BadFrame``. At most ``MAX_ANSWERED`` nonces are remembered as used
(those of the last ``CHALLENGE_TTL_S``: only clients that know the token, or any local one of a
server without a token, add to them); past that, handshakes are refused until they expire. The
nonces revoked (named in a ``release`` before their ``Handshake`` came) are remembered apart, at
most ``MAX_REVOKED``: a release names ids no MAC can check, so a client could name made-up ones
by the thousand; past that, revocations are dropped (logged at most once per
``CHALLENGE_TTL_S``, naming no id), and no handshake is refused.

Threading: none of its own; the server calls it under its state lock, from its loop thread.
"""

from __future__ import annotations

import hmac
import logging
import math
import secrets
import struct
from collections import deque

from torch_kv_tier.remote import protocol as p

logger = logging.getLogger(__name__)

CHALLENGE_TTL_S = 30.0  # a nonce must be answered within this time
MAX_ANSWERED = 65536  # used nonces remembered at most (~10 MiB): ~2,000 handshakes a second
MAX_REVOKED = 65536  # revoked nonces remembered at most (~10 MiB), apart from the used ones
_EXPIRY = struct.Struct(">d")  # a nonce: its expiry (``_expiry``), random bytes, its MAC
_RANDOM_BYTES = 8
_MAC_BYTES = p.NONCE_BYTES - _EXPIRY.size - _RANDOM_BYTES
_LENGTH = struct.Struct(">H")  # before each variable-length part the MAC covers


class Refused(Exception):
    """A hello or handshake the server refuses; the message is what the client is told."""


class Gate:
    """The handshake's checks for a server with ``token`` (``None``: no authentication), blocks
    of ``block_len`` bytes and config ``fingerprint`` (``""``: any)."""

    def __init__(self, token: str | None, block_len: int, fingerprint: str) -> None:
        self._token = token
        self._block_len = block_len
        self._fingerprint = fingerprint
        self._secret = secrets.token_bytes(32)  # this process's: a restart makes nonces stale
        # a nonce's expiry is on the server's clock moved by this (its uptime is nobody's business)
        self._clock_offset = float(secrets.randbelow(1 << 40))
        self._answered: set[bytes] = set()  # nonces used up by a handshake, until they expire
        self._revoked: set[bytes] = set()  # nonces revoked before any handshake used them
        self._forget: deque[tuple[float, bytes]] = deque()  # (when, nonce), in order of when
        self._dropped = 0  # revocations dropped (past ``MAX_REVOKED``) since the last warning
        self._warned_at = -math.inf  # when that warning was logged

    def hello(self, identity: bytes, hello: p.Hello, now: float) -> p.Challenge:
        """A nonce for the connection ``identity`` and the client nonce of ``hello``, to be
        answered by ``now + CHALLENGE_TTL_S``."""
        if hello.version != p.PROTOCOL_VERSION:
            raise Refused(f"protocol version {hello.version} != {p.PROTOCOL_VERSION}")
        if not 16 <= len(hello.client_nonce) <= 64:
            raise p.BadFrame(f"client nonce must be 16..64 bytes, got {len(hello.client_nonce)}")
        expiry = now + CHALLENGE_TTL_S + self._clock_offset
        body = _EXPIRY.pack(expiry) + secrets.token_bytes(_RANDOM_BYTES)
        nonce = body + self._mac(identity, hello.client_nonce, body)
        token = self._token
        proof = p.server_proof(token, nonce, hello.client_nonce) if token else b""
        return p.Challenge(p.PROTOCOL_VERSION, hello.seq, nonce, proof)

    def check(self, identity: bytes, hs: p.Handshake, now: float) -> None:
        """Raise ``Refused`` unless ``hs`` answers, in time and for the first time, a nonce
        ``identity`` was given, and its client may open a session here. The nonce is used up
        once the proof passed, whatever the later checks say."""
        if hs.version != p.PROTOCOL_VERSION:
            raise Refused(f"protocol version {hs.version} != {p.PROTOCOL_VERSION}")
        nonce = hs.nonce
        if not self._issued(identity, hs.client_nonce, nonce, now) or self._known(nonce):
            raise Refused(p.STALE_NONCE)
        token = self._token
        if token and not p.proof_matches(p.client_proof(token, nonce, hs.client_nonce), hs.proof):
            raise Refused("bad token")
        if len(self._answered) >= MAX_ANSWERED:
            raise Refused(
                f"more than {MAX_ANSWERED} handshakes in the last {CHALLENGE_TTL_S:g} s: "
                + p.TRY_AGAIN_LATER
            )
        self._use(self._answered, nonce, now)
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

    def revoke(self, session_ids: list[str], now: float) -> None:
        """Use up the nonces of these (would-be) sessions: a session's id is the nonce its
        handshake answered, in hex, so a ``Handshake`` still on its way with one is refused.
        Ids that are no nonce still to be answered are ignored. Past ``MAX_REVOKED``,
        revocations are dropped, logged at most once per ``CHALLENGE_TTL_S``: a line naming
        each id flooded the log (a release names 64), and wrote out the id of a session that a
        handshake still on its way then opened: anyone who read the log could end it."""
        for session_id in session_ids:
            try:
                nonce = bytes.fromhex(session_id)
            except ValueError:
                continue
            if len(nonce) != p.NONCE_BYTES or self._known(nonce):
                continue
            if not now <= self._expiry(nonce) <= now + CHALLENGE_TTL_S:
                continue  # expired, or no nonce of this process: nothing can answer it
            if len(self._revoked) >= MAX_REVOKED:
                self._dropped += 1
                continue
            self._use(self._revoked, nonce, now)
        if self._dropped and now - self._warned_at >= CHALLENGE_TTL_S:
            logger.warning(
                "%d revocations dropped: %d nonces were revoked within %g s already (their "
                "handshakes, if any come, open sessions). Logged at most every %g s",
                self._dropped,
                MAX_REVOKED,
                CHALLENGE_TTL_S,
                CHALLENGE_TTL_S,
            )
            self._dropped, self._warned_at = 0, now

    def expire(self, now: float) -> None:
        """Forget the used and revoked nonces that expired (no handshake can answer them)."""
        forget = self._forget
        while forget and forget[0][0] < now:
            nonce = forget.popleft()[1]
            self._answered.discard(nonce)
            self._revoked.discard(nonce)

    def _known(self, nonce: bytes) -> bool:
        """Whether ``nonce`` was used up or revoked (and has not expired since)."""
        return nonce in self._answered or nonce in self._revoked

    def _use(self, nonces: set[bytes], nonce: bytes, now: float) -> None:
        # kept until ``now + CHALLENGE_TTL_S``, past its expiry: ``_forget`` stays in order
        nonces.add(nonce)
        self._forget.append((now + CHALLENGE_TTL_S, nonce))

    def _issued(self, identity: bytes, client_nonce: bytes, nonce: bytes, now: float) -> bool:
        """Whether this process gave ``nonce`` to ``identity`` for ``client_nonce``, and it has
        not expired by ``now``."""
        if len(nonce) != p.NONCE_BYTES or not 16 <= len(client_nonce) <= 64:
            return False
        if self._expiry(nonce) < now:
            return False
        body = nonce[:-_MAC_BYTES]
        return hmac.compare_digest(nonce[-_MAC_BYTES:], self._mac(identity, client_nonce, body))

    def _expiry(self, nonce: bytes) -> float:
        """When ``nonce`` expires, on the server's clock."""
        return float(_EXPIRY.unpack_from(nonce)[0]) - self._clock_offset

    def _mac(self, identity: bytes, client_nonce: bytes, body: bytes) -> bytes:
        parts = (_LENGTH.pack(len(identity)), identity, _LENGTH.pack(len(client_nonce)))
        message = b"".join((*parts, client_nonce, body))
        return hmac.digest(self._secret, message, "sha256")[:_MAC_BYTES]


__all__ = ["CHALLENGE_TTL_S", "MAX_ANSWERED", "MAX_REVOKED", "Gate", "Refused"]
