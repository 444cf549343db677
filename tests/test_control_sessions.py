"""Host sessions over the control plane: handshakes (fingerprints, accepts never read or that the
client cannot use), releases of sessions (live, too many for one handshake, before their
handshake, over a session of their own), and stats of more sessions than a frame holds."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier.connections import Dial
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import HandshakeRejected, Region, RemoteSession, ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.handshake import AcceptLost
from torch_kv_tier.session_releases import _RELEASE_TRIES


def test_a_fingerprint_longer_than_any_config_is_rejected() -> None:
    with (
        ServerProcess.start(8, BLOCK_LEN) as server,
        pytest.raises(HandshakeRejected, match="fingerprint longer"),
    ):
        RemoteSession.open(
            server.address,
            agent_metadata=b"x",
            region=Region(4096, 8, BLOCK_LEN),
            config_fingerprint="f" * (p.MAX_FINGERPRINT + 1),
        )


def test_a_release_of_a_session_the_host_still_counts_live_ends_it_clean() -> None:
    """Regression (found by the shared stress with host freezes): a tier gave up its session
    while the host was frozen, and its redial released that session before the host had ended
    it; the release was ignored, the session then expired, and its slots stayed held forever."""
    with ServerProcess.start(32, BLOCK_LEN) as server:
        old = fake_session(server.address, slots=16)
        new = fake_session(server.address, slots=8, release=[old.session_id])
        stats = new.stats()
        assert stats["held_blocks"] == 0 and stats["leased_blocks"] == 8
        assert wait_for(lambda: old.lost is not None, 10.0)  # the host no longer knows it
        old.close()
        new.close()


def test_more_sessions_to_release_than_a_handshake_carries_are_all_released() -> None:
    """A handshake carries at most ``MAX_RELEASE`` sessions to release: the rest of a longer
    list (a host lost and redialled many times) were dropped, and the host held their slots
    for good. They go out in ``Release`` messages once the session is open."""
    n = p.MAX_RELEASE + 6
    with ServerProcess.start(n + 8, BLOCK_LEN) as server:
        ended = []
        for _ in range(n):
            session = fake_session(server.address, slots=1)
            session.close(clean=False)  # as if a write of it could still land: held
            ended.append(session.session_id)
        with fake_session(server.address, slots=8, release=ended) as new:
            assert wait_for(lambda: new.stats()["held_blocks"] == 0, 10.0), new.stats()
            assert new.stats()["leased_blocks"] == 8


def _hello(address: str) -> tuple[zmq.Socket[bytes], p.Challenge]:
    """A raw control connection to ``address`` that said hello; its challenge."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://{address}")
    sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, 1, b"c" * 32)))
    assert sock.poll(10_000)
    challenge = p.decode_server(sock.recv())
    assert isinstance(challenge, p.Challenge)
    return sock, challenge


def _private_handshake(nonce: bytes) -> bytes:
    region = Region(0x10000, 8, BLOCK_LEN)
    hs = p.Handshake(
        p.PROTOCOL_VERSION, 2, nonce, b"", b"x", region, "", None, private=True,
        client_nonce=b"c" * 32,
    )  # fmt: skip
    return p.encode(hs)


def test_stats_of_more_sessions_than_a_frame_holds_are_cut_short_not_a_lost_session() -> None:
    """A host with a few thousand sessions (a fleet's every tier joins every host; the sessions
    list takes ~250 B each) answered ``stats()`` with a frame over ``MAX_FRAME_BYTES``: the
    asking tier's socket refused it and dropped the connection, so asking for stats lost the
    session. The host cuts the lists short to fit, and says how much it left out."""
    n = 4500  # ~1.1 MiB of sessions with names of 128 characters
    region = Region(0x10000, 8, BLOCK_LEN)
    extra = ["--max-sessions", str(n + 8), "--lease-timeout", "600"]
    with ServerProcess.start(64, BLOCK_LEN, extra_args=extra) as server:
        sock, challenge = _hello(server.address)
        try:
            for i in range(n):
                if i:
                    sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, 1, b"c" * 32)))
                    assert sock.poll(10_000)
                    challenge = p.decode_server(sock.recv())  # type: ignore[assignment]
                name = f"{i:0128d}"
                hs = p.Handshake(
                    p.PROTOCOL_VERSION, 2, challenge.nonce, b"", b"x", region, "", None, name,
                    client_nonce=b"c" * 32,
                )  # fmt: skip
                sock.send(p.encode(hs))
                assert sock.poll(10_000)
                assert isinstance(p.decode_server(sock.recv()), p.Accept)
            with fake_session(server.address, private=False) as asking:
                stats = asking.stats()
                assert asking.lost is None
            assert stats["sessions_omitted"] > 0
            assert len(stats["sessions"]) + stats["sessions_omitted"] == n + 1
        finally:
            sock.close(linger=0)


def test_a_session_whose_accept_was_never_read_is_released_by_its_id() -> None:
    """An Accept queued but never read (the client's deadline passed first): the client knows
    the session's id all the same (the nonce it answered) and names it in its next handshake's
    release, which ends the session clean."""
    with ServerProcess.start(32, BLOCK_LEN) as server:
        sock, challenge = _hello(server.address)
        try:
            sock.send(_private_handshake(challenge.nonce))
            assert sock.poll(10_000)  # the Accept is there, unread
            with fake_session(server.address, slots=8, release=[challenge.nonce.hex()]) as new:
                stats = new.stats()
            assert len(stats["sessions"]) == 1, stats["sessions"]
            assert (stats["held_blocks"], stats["leased_blocks"]) == (0, 8), stats
        finally:
            sock.close(linger=0)


def test_a_session_released_before_its_handshake_arrived_never_opens() -> None:
    """The release can overtake the handshake it gives up (two connections): the nonce is
    revoked, so the late handshake is refused and nothing is leased for it."""
    with ServerProcess.start(32, BLOCK_LEN) as server:
        sock, challenge = _hello(server.address)
        try:
            with fake_session(server.address, slots=8, release=[challenge.nonce.hex()]) as new:
                sock.send(_private_handshake(challenge.nonce))
                assert sock.poll(10_000)
                reply = p.decode_server(sock.recv())
                assert isinstance(reply, p.Reject) and "nonce" in reply.reason, reply
                assert new.stats()["leased_blocks"] == 8
        finally:
            sock.close(linger=0)


@contextlib.contextmanager
def _host_that_never_accepts(handshakes: int) -> Iterator[tuple[str, list[p.Handshake]]]:
    """A control port that answers hello and then nothing (a frozen host, or its Accept lost):
    the ``i``-th hello's nonce is ``i`` repeated. Yields its address and the ``Handshake``s it
    got, until it got ``handshakes`` of them."""
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got: list[p.Handshake] = []

    def host() -> None:
        while len(got) < handshakes and router.poll(20_000):
            identity, frame = router.recv_multipart()
            message = p.decode_client(frame)
            if isinstance(message, p.Hello):
                nonce = bytes([len(got)]) * p.NONCE_BYTES
                challenge = p.Challenge(p.PROTOCOL_VERSION, 1, nonce, b"")
                router.send_multipart([identity, p.encode(challenge)])
            elif isinstance(message, p.Handshake):
                got.append(message)

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}", got
        thread.join(timeout=10)
    finally:
        router.close(linger=0)


def test_a_tier_whose_accept_never_came_releases_that_session_at_once() -> None:
    """A host that answers hello and then nothing (frozen, or its Accept lost): the tier's
    connect raises ``AcceptLost`` (a ``TimeoutError``) naming the session the host may have
    opened, and, nothing dialling that host, the tier names it at once in a handshake of its
    own (a private lease so opened was held for good when no connect there came next)."""
    with (
        _host_that_never_accepts(2) as (address, handshakes),
        TierManager.create(4, BLOCK_LEN, name="lost-accept") as tier,
    ):
        with pytest.raises(AcceptLost) as lost:
            tier.connect(address, private=True, timeout_s=0.5)
        assert wait_for(lambda: len(handshakes) == 2, 10.0), handshakes
    assert lost.value.session_id == (b"\x00" * p.NONCE_BYTES).hex()
    assert [h.release for h in handshakes] == [[], [(b"\x00" * p.NONCE_BYTES).hex()]]


def test_a_release_over_a_session_of_its_own_keeps_what_its_tries_may_have_opened() -> None:
    """A removed host's ended sessions go to it over a session of their own, in a few tries:
    a try whose Accept never came may have opened a session, which the next try's handshake
    left out (the host held it for good), and once every try failed the tier forgot them all,
    though a host that did not answer (frozen a while) still holds them. Each try names what
    the earlier ones may have opened, and the last one's failure keeps them all, to be named
    again (the next time a session of that host resolves, a connect there, or ``close``)."""
    with (
        _host_that_never_accepts(_RELEASE_TRIES) as (address, handshakes),
        TierManager.create(4, BLOCK_LEN, name="own-release") as tier,
    ):
        tier._release_over_own_session(Dial(address, None, False, None, 0.5, 10.0), ["ended"])
        opened = [(bytes([i]) * p.NONCE_BYTES).hex() for i in range(_RELEASE_TRIES)]
        assert [h.release for h in handshakes] == [
            ["ended", *opened[:i]] for i in range(_RELEASE_TRIES)
        ]
        assert tier._ended.resolved[address] == ["ended", *opened]


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("lease_timeout_s", 0.0, "lease timeout"),
        ("lease_timeout_s", math.nan, "lease timeout"),
        ("lease_stop", 9, "lease"),
        ("region", Region(0x10000, 0, BLOCK_LEN), "num_blocks > 0"),
        ("max_granted", -1, "max granted"),
    ],
    ids=[
        "no-lease-timeout",
        "nan-lease-timeout",
        "lease-past-the-region",
        "empty-region",
        "negative-max-granted",
    ],
)
def test_an_accept_the_client_cannot_use_is_refused_and_the_session_ended_on_the_host(
    field: str, value: Any, problem: str
) -> None:
    """A host (a bug, another version) accepted with a lease timeout of 0 or NaN, which made
    the session heartbeat in a busy loop (its interval is a third of it), or with a lease or
    region no session can use, or a negative cap on granted slots (a tier's reserve below 0:
    it was never topped up ahead of the stores, which waited for grants): the session opened
    all the same. ``open`` refuses it, saying what is wrong, and ends the session on the
    host."""
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got: list[p.ClientMessage] = []

    def host() -> None:  # accepts every handshake with the bad field
        while not any(isinstance(m, p.Disconnect) for m in got) and router.poll(10_000):
            identity, frame = router.recv_multipart()
            message = p.decode_client(frame)
            got.append(message)
            if isinstance(message, p.Hello):
                challenge = p.Challenge(p.PROTOCOL_VERSION, 1, b"n" * p.NONCE_BYTES, b"")
                router.send_multipart([identity, p.encode(challenge)])
            elif isinstance(message, p.Handshake):
                accept = p.Accept(
                    2, "sid", "s1", "bad", b"meta", Region(0x10000, 8, BLOCK_LEN), 0, 4, 30.0
                )
                setattr(accept, field, value)
                router.send_multipart([identity, p.encode(accept)])

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    try:
        with pytest.raises(ConnectionError, match=f"unusable.*{problem}"):
            fake_session(f"127.0.0.1:{port}", slots=4, timeout_s=5.0).close()
        thread.join(timeout=10)
        assert isinstance(got[-1], p.Disconnect) and got[-1].session_id == "sid", got
    finally:
        router.close(linger=0)
