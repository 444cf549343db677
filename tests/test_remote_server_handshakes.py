"""``torch-kv-tier serve``'s handshakes and leases: rejections say why, a client checks the
host knows the token, clients get disjoint leases, an ``Accept`` that cannot be queued ends its
session clean."""

from __future__ import annotations

import pytest
import torch
import zmq
from remote_server_support import (
    CONFIG,
    POOL,
    exchange,
    metrics_page,
    module_open_server,
    module_token_server,
)
from remote_support import (
    BLOCK_LEN,
    TOKEN,
    Client,
    fake_session,
)

from torch_kv_tier.remote import HandshakeRejected, ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.server import Server
from torch_kv_tier.transport import config_fingerprint

token_server = module_token_server()
open_server = module_open_server()


def test_rejections_carry_the_reason(token_server: ServerProcess) -> None:
    addr = token_server.address
    cases = [
        ("bad token", {"token": "not-the-token"}),
        ("bad token", {}),
        ("block_len 8192 != 4096", {"token": TOKEN, "block_len": 8192}),
        ("config fingerprint mismatch", {"token": TOKEN, "config_fingerprint": "0123456789abcdef"}),
    ]
    for reason, kwargs in cases:
        with pytest.raises(HandshakeRejected) as info:
            fake_session(addr, **kwargs)
        assert info.value.reason == reason
    # the same fingerprint, or none at all, is accepted
    for fingerprint in (config_fingerprint(CONFIG), ""):
        fake_session(addr, token=TOKEN, config_fingerprint=fingerprint).close()

    whole = fake_session(addr, token=TOKEN)  # no slot count: the whole pool
    assert whole.lease == range(POOL)
    with pytest.raises(HandshakeRejected) as info:
        fake_session(addr, token=TOKEN, slots=1)
    assert info.value.reason == "no free slots"
    whole.close()  # a clean disconnect returns the lease at once
    fake_session(addr, token=TOKEN, slots=POOL).close()


def test_protocol_version_mismatch_is_rejected(token_server: ServerProcess) -> None:
    reply = exchange(token_server.address, [p.encode(p.Hello(99, 7, b"n" * 32))])
    assert reply == p.Reject(7, f"protocol version 99 != {p.PROTOCOL_VERSION}")


def test_client_refuses_server_that_cannot_prove_the_token(open_server: ServerProcess) -> None:
    with pytest.raises(HandshakeRejected) as info:
        fake_session(open_server.address, token=TOKEN)
    assert info.value.reason == "server did not prove it knows the token"


def test_three_clients_get_disjoint_leases_and_their_own_bytes(
    token_server: ServerProcess,
) -> None:
    addr = token_server.address
    clients: list[Client] = []
    try:
        for _ in range(3):
            clients.append(Client(addr, 16, token=TOKEN, private=True, slots=POOL // 3))
        leases = [set(c.session.lease) for c in clients]
        assert all(len(lease) == POOL // 3 for lease in leases)
        assert not (leases[0] & leases[1] or leases[0] & leases[2] or leases[1] & leases[2])
        assert len({c.session.public_id for c in clients}) == 3  # three sessions
        assert len({c.session.peer_id for c in clients}) == 1  # of one host: its stable id

        originals = [c.blocks.clone() for c in clients]
        for c in clients:  # each writes its 16 blocks to the top of its lease
            c.move("write", range(16), list(c.session.lease)[-16:])
        for c, original in zip(clients, originals, strict=True):
            c.blocks.zero_()
            c.move("read", range(16), list(c.session.lease)[-16:])
            assert torch.equal(c.blocks, original)

        with pytest.raises(HandshakeRejected, match="no free slots"):
            fake_session(addr, token=TOKEN)
        clients[0].session.report_usage(written=16 * BLOCK_LEN, read=16 * BLOCK_LEN, slots_used=16)
        freed = clients[0].session.lease
        stats = clients[1].session.stats()
        assert (stats["leased_blocks"], stats["free_blocks"], len(stats["sessions"])) == (
            POOL,
            0,
            3,
        )
        assert sorted(tuple(s["lease"]) for s in stats["sessions"]) == sorted(
            (c.session.lease.start, c.session.lease.stop) for c in clients
        )
        clients.pop(0).close()
        late = fake_session(addr, token=TOKEN)
        assert late.lease == freed
        late.close()

        metrics = metrics_page(stats["metrics_port"])
        assert "torch_kv_tier_server_sessions 2\n" in metrics
        assert 'torch_kv_tier_server_bytes_total{direction="written"} 65536\n' in metrics
    finally:
        for c in clients:
            c.close()


class _PeersGone:
    """A ROUTER socket whose peer hung up: ``frames`` arrive, and only a ``Challenge`` can be
    sent back (the peer is gone by the time of the ``Accept``)."""

    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []
        self.sent: list[p.ServerMessage] = []

    def get(self, option: int) -> int:
        return zmq.POLLIN if self.frames else 0

    def recv_multipart(self, flags: int) -> list[bytes]:
        return self.frames.pop(0)

    def send_multipart(self, frames: list[bytes], flags: int) -> None:
        message = p.decode_server(frames[1])
        if not isinstance(message, p.Challenge):
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self.sent.append(message)

    def close(self, linger: int = 0) -> None:
        pass


def test_a_session_whose_accept_cannot_be_queued_ends_clean() -> None:
    """Found by review: an Accept that could not be queued (its client hung up after sending
    the handshake) was dropped and its session left open; it then expired with its lease held
    for good, since nobody knew its id. Its client never learned of the lease, so never wrote
    it: the session ends clean, its slots free at once."""
    from torch_kv_tier.remote.server_config import ServerConfig

    server = Server(ServerConfig(num_blocks=32, block_len=BLOCK_LEN))
    try:
        assert server._socket is not None
        server._socket.close(linger=0)
        server._socket = sock = _PeersGone()  # type: ignore[assignment]
        sock.frames.append([b"peer", p.encode(p.Hello(p.PROTOCOL_VERSION, 1, b"c" * 32))])
        server._drain()
        (challenge,) = sock.sent
        assert isinstance(challenge, p.Challenge)
        region = p.Region(0x10000, 8, BLOCK_LEN)
        handshake = p.Handshake(
            p.PROTOCOL_VERSION, 2, challenge.nonce, b"", b"x", region, "", None, private=True,
            client_nonce=b"c" * 32,
        )  # fmt: skip
        sock.frames.append([b"peer", p.encode(handshake)])
        server._drain()
        stats = server.stats()
        assert stats["handshakes_accepted"] == 1 and stats["sessions"] == []
        assert (stats["leased_blocks"], stats["held_blocks"], stats["free_blocks"]) == (0, 0, 32)
    finally:
        server.close()
