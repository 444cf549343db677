"""``torch-kv-tier serve`` under bad input: fuzzed, malformed, oversized, non-ZMTP and deeply
nested frames are answered or dropped, and the host keeps serving."""

from __future__ import annotations

import socket

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_server_support import exchange, module_open_server
from remote_support import (
    BLOCK_LEN,
    fake_session,
)

from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote import protocol as p

open_server = module_open_server()

TAGS = ["hello", "handshake", "heartbeat", "stats", "disconnect", "accept", "bogus"]
FIELDS = ["version", "seq", "nonce", "client_nonce", "proof", "session_id", "region", "slots"]
VALID = [
    p.encode(p.Hello(p.PROTOCOL_VERSION, 1, b"c" * 32)),
    p.encode(p.Heartbeat(3, "0" * 32, 10, 10, 1)),
    p.encode(p.StatsRequest(4)),
    p.encode(p.Disconnect(5, "f" * 32)),
    p.encode(
        p.Handshake(
            p.PROTOCOL_VERSION, 2, b"n" * 32, b"", b"meta", p.Region(1, 1, BLOCK_LEN), "", None, "x"
        )
    ),
]
ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
values = st.one_of(
    ints,
    st.binary(max_size=64),
    st.text(max_size=16),
    st.none(),
    st.lists(ints, max_size=3),
    st.dictionaries(st.text(max_size=8), ints, max_size=3),
)
frames = st.one_of(
    st.binary(max_size=256),
    st.sampled_from(VALID).flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda n: f[:n])),
    st.sampled_from(VALID),
    st.builds(
        lambda tag, fields: msgspec.msgpack.encode({"type": tag, **fields}),
        st.sampled_from(TAGS),
        st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    ),
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(message=st.lists(frames, min_size=1, max_size=3))
def test_fuzzed_frames_never_stop_the_server(
    open_server: ServerProcess, message: list[bytes]
) -> None:
    exchange(open_server.address, message, wait_s=0.02)
    assert open_server.proc.poll() is None, open_server.stderr


def test_bad_frames_are_answered_or_dropped_and_the_server_keeps_serving(
    open_server: ServerProcess,
) -> None:
    addr = open_server.address
    reply = exchange(addr, [b"\xc1"])
    assert isinstance(reply, p.Error) and reply.reason.startswith("malformed frame")
    reply = exchange(addr, [p.encode(p.Heartbeat(9, "no-such-session"))])
    assert reply == p.Error(9, p.UNKNOWN_SESSION)
    # a handshake that skipped hello
    reply = exchange(addr, [VALID[-1]])
    assert isinstance(reply, p.Reject) and "nonce" in reply.reason
    # oversized frames make ZeroMQ drop the connection before the server sees them
    assert exchange(addr, [b"\0" * (p.MAX_FRAME_BYTES + 1)], wait_s=0.5) is None
    # bytes that are not even ZMTP
    host, port = addr.rsplit(":", 1)
    for junk in (b"\xff" * 10 + b"\x7f", b"GET / HTTP/1.0\r\n\r\n", bytes(range(256)) * 64):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(junk)
    session = fake_session(addr)
    stats = session.stats()
    session.close()
    assert open_server.proc.poll() is None
    assert stats["bad_frames"] >= 1 and stats["handshakes_accepted"] >= 1


def test_a_frame_nested_too_deeply_is_answered_and_the_server_keeps_serving(
    open_server: ServerProcess,
) -> None:
    """5 KiB of nested arrays in a key used to raise ``RecursionError`` out of the decoder and
    stop the host, with every session on it."""
    addr = open_server.address
    session = fake_session(addr, private=False)
    frame = p.encode(p.Touch(3, session.session_id, []))
    reply = exchange(addr, [frame[:-1] + b"\x91" * 5000 + b"\x01"])
    assert isinstance(reply, p.Error) and "nested too deeply" in reply.reason
    assert open_server.proc.poll() is None, open_server.stderr
    assert session.stats()["bad_frames"] >= 1 and session.lost is None
    session.close()
