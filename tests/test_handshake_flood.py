"""A flood of hellos from an unauthenticated peer must not keep a tier from joining a host: the
host's gate kept each connection's nonce in a table of 1,024, the oldest forgotten, so 1,024
hellos from new connections between a tier's ``Hello`` and its ``Handshake`` (a round trip)
pushed out that tier's nonce, and its handshake was refused as stale, again and again."""

from __future__ import annotations

import os
import time

import pytest
import zmq
from remote_support import BLOCK_LEN, TOKEN

from torch_kv_tier.remote import ServerProcess, handshake, server_handshake
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.server_handshake import CHALLENGE_TTL_S, Gate, Refused

FLOOD = 4096  # hellos, each from a connection of its own: four times the old table
REGION = p.Region(0x10000, 8, BLOCK_LEN)


def _hello(seq: int = 1) -> tuple[p.Hello, bytes]:
    client_nonce = os.urandom(32)
    return p.Hello(p.PROTOCOL_VERSION, seq, client_nonce), client_nonce


def _handshake(challenge: p.Challenge, client_nonce: bytes, token: str | None) -> p.Handshake:
    proof = p.client_proof(token, challenge.nonce, client_nonce) if token else b""
    return p.Handshake(
        p.PROTOCOL_VERSION, 2, challenge.nonce, proof, b"meta", REGION, "", None,
        client_nonce=client_nonce,
    )  # fmt: skip


def _gate_challenge(gate: Gate, identity: bytes, now: float) -> p.Handshake:
    hello, client_nonce = _hello()
    return _handshake(gate.hello(identity, hello, now), client_nonce, TOKEN)


def test_a_flood_of_hellos_between_a_hello_and_its_handshake_is_no_refusal() -> None:
    gate = Gate(TOKEN, BLOCK_LEN, "")
    handshake = _gate_challenge(gate, b"tier", 0.0)
    for i in range(FLOOD):
        gate.hello(i.to_bytes(5, "big"), _hello()[0], 0.1)
    gate.expire(0.2)
    gate.check(b"tier", handshake, 0.3)  # (refused as stale, unfixed)


def test_a_nonce_opens_one_session_for_its_own_connection_within_its_time() -> None:
    gate = Gate(TOKEN, BLOCK_LEN, "")
    handshake = _gate_challenge(gate, b"tier", 0.0)
    with pytest.raises(Refused, match="stale"):  # another connection that captured it
        gate.check(b"thief", handshake, 1.0)
    gate.check(b"tier", handshake, 1.0)
    with pytest.raises(Refused, match="stale"):  # replayed, even on its own connection
        gate.check(b"tier", handshake, 2.0)
    late = _gate_challenge(gate, b"tier", 0.0)
    with pytest.raises(Refused, match="stale"):
        gate.check(b"tier", late, CHALLENGE_TTL_S + 0.1)


def test_a_bad_proof_uses_nothing_and_a_revoked_nonce_opens_nothing() -> None:
    gate = Gate(TOKEN, BLOCK_LEN, "")
    handshake = _gate_challenge(gate, b"tier", 0.0)
    forged = _handshake(p.Challenge(p.PROTOCOL_VERSION, 1, handshake.nonce, b""), b"x" * 32, None)
    with pytest.raises(Refused, match="stale"):  # another client nonce: not what it was made for
        gate.check(b"tier", forged, 1.0)
    guessed = _handshake(
        p.Challenge(p.PROTOCOL_VERSION, 1, handshake.nonce, b""), handshake.client_nonce, "guess"
    )
    with pytest.raises(Refused, match="bad token"):
        gate.check(b"tier", guessed, 1.0)
    revoked = _gate_challenge(gate, b"tier", 0.0)
    gate.revoke([revoked.nonce.hex(), "not hex", "ab" * 40], 1.0)
    with pytest.raises(Refused, match="stale"):  # its client gave up waiting: never opens
        gate.check(b"tier", revoked, 1.5)
    gate.check(b"tier", handshake, 2.0)  # the real one, after a guess and a forgery


def _received(sock: zmq.Socket[bytes]) -> bytes:
    assert sock.poll(10_000), "no answer within 10 s"
    return sock.recv()


def _challenged(sock: zmq.Socket[bytes]) -> p.Challenge:
    challenge = p.decode_server(_received(sock))
    assert isinstance(challenge, p.Challenge), challenge
    return challenge


def test_a_tier_joins_a_serving_host_after_a_flood_of_hellos(tmp_path: os.PathLike[str]) -> None:
    """The host answered every flooding hello (from 1,280 connections) between the tier's hello
    and its handshake: the tier is accepted, and its handshake replayed is refused."""
    token = os.path.join(tmp_path, "token")
    with open(token, "w", encoding="utf-8") as f:
        f.write(TOKEN)
    os.chmod(token, 0o600)
    context = zmq.Context()
    # A context makes at most 1,023 sockets by default, and closed ones count until its reaper
    # thread has freed them: the second 640 failed ("Too many open files") 1 run in 30 or so.
    context.set(zmq.MAX_SOCKETS, 4 * 640)
    try:
        with ServerProcess.start(16, BLOCK_LEN, token_file=token) as server:
            endpoint = f"tcp://{server.address}"
            tier = context.socket(zmq.DEALER)
            tier.connect(endpoint)
            hello, client_nonce = _hello()
            tier.send(p.encode(hello))
            handshake = p.encode(_handshake(_challenged(tier), client_nonce, TOKEN))
            for _ in range(2):
                flooders = [context.socket(zmq.DEALER) for _ in range(640)]
                for sock in flooders:
                    sock.connect(endpoint)
                    sock.send(p.encode(_hello()[0]))
                for sock in flooders:
                    _challenged(sock)
                    sock.close(linger=0)
            tier.send(handshake)
            assert tier.poll(10_000)
            accept = p.decode_server(tier.recv())
            assert isinstance(accept, p.Accept), accept  # (a Reject: stale nonce, unfixed)
            tier.send(handshake)
            assert tier.poll(10_000)
            replayed = p.decode_server(tier.recv())
            assert isinstance(replayed, p.Reject) and replayed.reason == p.STALE_NONCE
            tier.close(linger=0)
    finally:
        context.destroy(linger=0)


def test_the_nonces_remembered_are_bounded_and_only_those_whose_proof_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``MAX_ANSWERED`` used nonces in the last ``CHALLENGE_TTL_S``, handshakes are refused
    (never is an older one forgotten early: it could be replayed); bad proofs add nothing, and
    revocations are bounded apart (``MAX_REVOKED``: past it they are dropped)."""
    monkeypatch.setattr(server_handshake, "MAX_ANSWERED", 2)
    monkeypatch.setattr(server_handshake, "MAX_REVOKED", 1)
    gate = Gate(TOKEN, BLOCK_LEN, "")
    for _ in range(100):  # a wrong token: each uses nothing
        bad = _gate_challenge(gate, b"flood", 0.0)
        bad.proof = b"x" * 32
        with pytest.raises(Refused, match="bad token"):
            gate.check(b"flood", bad, 0.5)
    first, second, third, fourth = (_gate_challenge(gate, b"tier", 0.0) for _ in range(4))
    gate.check(b"tier", first, 1.0)
    gate.check(b"tier", second, 1.0)
    with pytest.raises(Refused, match="try again later"):
        gate.check(b"tier", third, 1.0)
    gate.revoke([third.nonce.hex(), fourth.nonce.hex()], 1.0)  # room for one (a warning)
    with pytest.raises(Refused, match="stale"):
        gate.check(b"tier", third, 1.0)
    with pytest.raises(Refused, match="stale"):  # still remembered, for as long as it is valid
        gate.check(b"tier", first, 2.0)
    gate.expire(1.0 + CHALLENGE_TTL_S + 0.1)  # the used ones expired, and are forgotten
    late = _gate_challenge(gate, b"tier", 31.0)
    gate.check(b"tier", late, 31.5)


def test_made_up_session_ids_in_releases_refuse_no_tier(tmp_path: os.PathLike[str]) -> None:
    """A release names session ids that no MAC can check, and a nonce shows where the host's
    expiries lie: one authenticated client named 65,920 made-up ids in 1,030 ``Release``
    frames (0.2 s), they filled the host's used nonces, and every tier's handshake was refused
    ("try again later") for 30 s, again and again. Revoked nonces are now bounded apart."""
    token = os.path.join(tmp_path, "token")
    with open(token, "w", encoding="utf-8") as f:
        f.write(TOKEN)
    os.chmod(token, 0o600)
    request = _handshake(p.Challenge(p.PROTOCOL_VERSION, 1, b"", b""), b"", None)
    with ServerProcess.start(64, BLOCK_LEN, token_file=token) as server:
        sock, monitor = handshake.connect(server.address)
        try:
            deadline = time.monotonic() + 10
            accept = handshake.handshake(sock, server.address, deadline, TOKEN, request)
            seen = bytes.fromhex(accept.session_id)  # its first 8 bytes: an expiry of the host's
            for _ in range(server_handshake.MAX_REVOKED // p.MAX_RELEASE + 6):
                made_up = [(seen[:8] + os.urandom(24)).hex() for _ in range(p.MAX_RELEASE)]
                sock.send(p.encode(p.Release(5, accept.session_id, made_up)))
            sock.send(p.encode(p.Heartbeat(7, accept.session_id)))
            while not isinstance(p.decode_server(_received(sock)), p.HeartbeatAck):
                pass  # (every Release before it was read)
            tier, tier_monitor = handshake.connect(server.address)
            try:  # (HandshakeRejected "... try again later", unfixed)
                deadline = time.monotonic() + 10
                handshake.handshake(tier, server.address, deadline, TOKEN, request)
            finally:
                handshake.close_sockets(tier, tier_monitor)
        finally:
            handshake.close_sockets(sock, monitor)


def test_a_nonce_does_not_tell_the_hosts_uptime() -> None:
    """A nonce carries its expiry, which was the host's monotonic clock plus 30 s: anyone who
    said hello learnt how long the host had been up. It is now moved by a random offset of the
    process, and still checked against the host's clock."""
    now = 1234.5
    nonces = [Gate(TOKEN, BLOCK_LEN, "").hello(b"id", _hello()[0], now).nonce for _ in range(4)]
    expiries = {server_handshake._EXPIRY.unpack_from(n)[0] for n in nonces}
    assert now + CHALLENGE_TTL_S not in expiries and len(expiries) == 4
    gate = Gate(TOKEN, BLOCK_LEN, "")
    gate.check(b"id", _gate_challenge(gate, b"id", now), now + CHALLENGE_TTL_S - 0.01)
    with pytest.raises(Refused):
        gate.check(b"id", _gate_challenge(gate, b"id", now), now + CHALLENGE_TTL_S + 0.01)


def test_revocations_past_the_bound_are_logged_once_a_while_naming_no_session(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past ``MAX_REVOKED``, each dropped revocation was a warning naming its id: a release of
    64 made 64 lines, and the id written was that of a session a handshake on its way then
    opened (anyone reading the log could end it with a ``Release``). One line a while, with
    the count, and no id."""
    monkeypatch.setattr(server_handshake, "MAX_REVOKED", 1)
    gate = Gate(TOKEN, BLOCK_LEN, "")
    ids = [_gate_challenge(gate, b"tier", 0.0).nonce.hex() for _ in range(4)]
    later = _gate_challenge(gate, b"tier", 20.0).nonce.hex()  # still valid at 31
    with caplog.at_level("WARNING", logger=server_handshake.__name__):
        gate.revoke(ids[:3], 1.0)  # room for one: two dropped, a line
        gate.revoke(ids[3:], 2.0)  # dropped, counted for the next line
        gate.revoke([later], 1.0 + CHALLENGE_TTL_S)  # dropped, and a line again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("2 revocations dropped") for line in lines)
    assert not [line for line in lines if any(sid in line for sid in [*ids, later])], lines
