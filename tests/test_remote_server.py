"""``torch-kv-tier serve`` as a child process: handshakes, leases, bad input, signals, liveness."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import psutil
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_support import (
    BLOCK_LEN,
    TOKEN,
    Client,
    control_ports,
    fake_session,
    fill_random,
    free_port,
    wait_for,
)

from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import HandshakeRejected, ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.server import Server
from torch_kv_tier.transport import config_fingerprint

CONFIG = {"model": "tiny-llama", "dtype": "bfloat16"}
POOL = 96


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def token_server(token_file: str) -> Iterator[ServerProcess]:
    """A server with a token and model config fields; every test leaves its pool free."""
    with ServerProcess.start(
        POOL,
        BLOCK_LEN,
        token_file=token_file,
        config_fields=CONFIG,
        extra_args=["--metrics-port", "0"],
    ) as server:
        yield server


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerProcess]:
    """A loopback server without a token; it reclaims silent clients' leases after 1 s."""
    with ServerProcess.start(32, BLOCK_LEN, extra_args=["--lease-timeout", "1"]) as server:
        yield server


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
    reply = _exchange(token_server.address, [p.encode(p.Hello(99, 7, b"n" * 32))])
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

        metrics = _metrics(stats["metrics_port"])
        assert "torch_kv_tier_server_sessions 2\n" in metrics
        assert 'torch_kv_tier_server_bytes_total{direction="written"} 65536\n' in metrics
    finally:
        for c in clients:
            c.close()


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
    _exchange(open_server.address, message, wait_s=0.02)
    assert open_server.proc.poll() is None, open_server.stderr


def test_bad_frames_are_answered_or_dropped_and_the_server_keeps_serving(
    open_server: ServerProcess,
) -> None:
    addr = open_server.address
    reply = _exchange(addr, [b"\xc1"])
    assert isinstance(reply, p.Error) and reply.reason.startswith("malformed frame")
    reply = _exchange(addr, [p.encode(p.Heartbeat(9, "no-such-session"))])
    assert reply == p.Error(9, p.UNKNOWN_SESSION)
    # a handshake that skipped hello
    reply = _exchange(addr, [VALID[-1]])
    assert isinstance(reply, p.Reject) and "nonce" in reply.reason
    # oversized frames make ZeroMQ drop the connection before the server sees them
    assert _exchange(addr, [b"\0" * (p.MAX_FRAME_BYTES + 1)], wait_s=0.5) is None
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
    reply = _exchange(addr, [frame[:-1] + b"\x91" * 5000 + b"\x01"])
    assert isinstance(reply, p.Error) and "nested too deeply" in reply.reason
    assert open_server.proc.poll() is None, open_server.stderr
    assert session.stats()["bad_frames"] >= 1 and session.lost is None
    session.close()


def test_sigterm_exits_zero_within_5s_releasing_everything() -> None:
    server = ServerProcess.start(16, BLOCK_LEN, extra_args=["--metrics-port", "0"])
    try:
        session = fake_session(server.address, heartbeat_timeout_s=30)
        t0 = time.monotonic()
        code = server.stop(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        server.kill()
    session.close()  # the server is gone: close must still return promptly
    assert code == 0, server.stderr
    assert elapsed < 5
    assert "closed" in server.stderr  # the NIXL registration was released
    assert server.stderr.rstrip().endswith("stopped")


# the host's sitecustomize: at exit it writes whether the host imported torch
_TORCH_AT_EXIT = """\
import atexit, os, sys

def _report():
    with open(os.environ["TKVT_TORCH_IMPORTED"], "w") as out:
        out.write(str("torch" in sys.modules))

atexit.register(_report)
"""


def test_a_host_never_imports_torch_and_serves_its_pool_disk_and_metrics(tmp_path: Path) -> None:
    """``serve`` with a DRAM pool starts without importing torch (~1.2 s of CPU per start): the
    pool is numpy memory, NIXL's backend is chosen without torch, the package imports lazily;
    its tiers still get their bytes back, and the disk tier and metrics still work."""
    (tmp_path / "sitecustomize.py").write_text(_TORCH_AT_EXIT)
    report = tmp_path / "torch_imported"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    keys = [f"no-torch-{i}".encode() for i in range(16)]
    with (
        ServerProcess.start(
            32,
            BLOCK_LEN,
            extra_args=[
                "--disk", str(tmp_path / "disk"), "--disk-bytes", str(64 * BLOCK_LEN),
                "--disk-admit", "1", "--metrics-port", "0",
            ],
            env={"PYTHONPATH": path, "TKVT_TORCH_IMPORTED": str(report)},
        ) as server,
        TierManager.create(16, BLOCK_LEN, name="writer") as writer,
        TierManager.create(16, BLOCK_LEN, name="reader") as reader,
    ):  # fmt: skip
        writer.connect(server.address)
        reader.connect(server.address)
        original = fill_random(writer)
        assert writer.store(keys, range(16)).result(timeout=30).ok
        assert wait_for(lambda: reader.lookup(keys) == len(keys), timeout_s=10)
        loaded = reader.load(keys, range(16)).result(timeout=30)
        assert loaded.ok, loaded.failed
        assert torch.equal(reader.arena.tensor, original)
        session = fake_session(server.address, private=False)
        assert wait_for(lambda: session.stats()["disk_copies"] == len(keys), timeout_s=10)
        port = session.stats()["metrics_port"]
        session.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert "torch_kv_tier_server_disk_keys 16\n" in response.read().decode()
        assert server.stop(timeout=10) == 0, server.stderr
    assert report.read_text() == "False"  # (absent: its sitecustomize never ran)


def test_every_public_name_of_the_lazy_package_resolves() -> None:
    """The package imports its public names on first use: each of ``__all__`` still resolves."""
    import torch_kv_tier

    for name in torch_kv_tier.__all__:
        assert getattr(torch_kv_tier, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Tier'"):
        torch_kv_tier.Tier  # noqa: B018


def test_nixl_is_loaded_without_torch_from_the_backend_import_nixl_picks() -> None:
    """``import_nixl_api`` loads the backend wheel ``import nixl`` would, in a fresh process."""
    api = "sys.modules['nixl._api'].__name__"
    plain = f"import sys, nixl._api; print({api})"
    ours = (
        "import sys; from torch_kv_tier.transport.nixl_import import import_nixl_api; "
        f"import_nixl_api(); print({api}, 'torch' in sys.modules)"
    )
    picked = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
        for code in (plain, ours)
    ]
    assert picked[1] == [picked[0][0], "False"]


def _session_child(address: str, *, private: bool) -> tuple[subprocess.Popen[str], str]:
    """A client process with a session at ``address`` (``private``: a lease of every slot), and
    the line it printed once connected: its lease's size and its session's id."""
    code = (
        "import sys, time\n"
        "from torch_kv_tier.remote import Region, RemoteSession\n"
        "s = RemoteSession.open(\n"
        f"    sys.argv[1], agent_metadata=b'x', region=Region(4096, 8, 4096), private={private}\n"
        ")\n"
        "print(len(s.lease), s.session_id, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, address], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    ready = select.poll()  # not select(): the test process may hold fds past FD_SETSIZE
    ready.register(child.stdout, select.POLLIN)
    if not ready.poll(60_000):
        child.kill()
        child.wait(timeout=10)
        raise AssertionError("the client never connected")
    return child, child.stdout.readline()


def test_a_killed_clients_lease_is_held_until_released(open_server: ServerProcess) -> None:
    """A client that stops heartbeating may only be frozen, with writes still to land: its lease
    goes to nobody, however long it waits, until the client releases the session."""
    addr = open_server.address
    probe = fake_session(addr, slots=1)
    reclaimed_before = probe.stats()["leases_reclaimed"]
    probe.close()
    child, line = _session_child(addr, private=True)
    try:
        size, session_id = line.split()
        assert size == "32"  # the whole pool
    finally:
        child.kill()
        child.wait(timeout=10)
    watcher = fake_session(addr, private=False)
    assert wait_for(lambda: watcher.stats()["held_blocks"] == 32, timeout_s=10)
    stats = watcher.stats()
    assert stats["leases_reclaimed"] == reclaimed_before + 1 and stats["held_sessions"] == 1
    time.sleep(1.5)  # well past the lease timeout: still held
    with pytest.raises(HandshakeRejected, match="no free slots .32 held"):
        fake_session(addr)
    watcher.release([session_id])  # what a returning client does once its writes resolved
    assert wait_for(lambda: watcher.stats()["held_blocks"] == 0, timeout_s=5)
    session = fake_session(addr)
    assert session.lease == range(32)
    session.close()
    watcher.close()


def _host_holds(server: ServerProcess, peer_port: int) -> bool:
    """Whether the host holds an established control connection from a peer's local port."""
    return any(
        c.raddr and c.raddr.port == peer_port and c.status == psutil.CONN_ESTABLISHED
        for c in psutil.Process(server.proc.pid).net_connections(kind="tcp")
    )


def test_a_frozen_clients_connection_is_closed_and_an_idle_ones_kept(
    open_server: ServerProcess,
) -> None:
    """A client frozen (or whose machine vanished) held its connection, a descriptor and its
    buffers on the host for good, long after its session expired; now the host closes a
    connection silent for two lease timeouts after a ZeroMQ ping. A client whose program is
    idle still answers the pings (its ZeroMQ I/O thread does) and keeps its connection."""
    addr = open_server.address
    before = control_ports(open_server)
    idle = zmq.Context.instance().socket(zmq.DEALER)
    idle.connect(f"tcp://{addr}")
    idle.send(p.encode(p.Hello(p.PROTOCOL_VERSION, 1, b"n" * 16)))
    assert idle.poll(10_000) and isinstance(p.decode_server(idle.recv()), p.Challenge)
    (idle_port,) = control_ports(open_server) - before
    child, _ = _session_child(addr, private=False)
    try:
        (child_port,) = control_ports(open_server, psutil.Process(child.pid))
        assert _host_holds(open_server, child_port)
        stop_process(child.pid)
        assert wait_for(lambda: not _host_holds(open_server, child_port), timeout_s=20)
        assert _host_holds(open_server, idle_port)
    finally:
        child.kill()
        child.wait(timeout=10)
        idle.close(linger=0)


def test_sessions_whose_heartbeats_queued_while_the_host_stalled_survive_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the host review: a host whose loop stalled past its lease timeout (frozen,
    busy) read, once it resumed, one batch of control messages and then checked the leases:
    the sessions whose heartbeats were still queued (a host with more sessions than
    ``MAX_BATCH``) were ended, their clients alive. A session's silence now counts only while
    the host listens. ``MAX_BATCH`` of 1 stands in for a host with more than 256 sessions."""
    from torch_kv_tier.remote import server as server_module
    from torch_kv_tier.remote.server_config import ServerConfig

    monkeypatch.setattr(server_module, "MAX_BATCH", 1)
    server = Server(ServerConfig(num_blocks=32, block_len=BLOCK_LEN, lease_timeout_s=1.0))
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,))
    loop.start()
    lost: list[str] = []
    sessions = [
        fake_session(server.address, private=False, heartbeat_timeout_s=60, on_lost=lost.append)
        for _ in range(4)
    ]
    try:
        with server._lock:  # the loop stalls: the clients' heartbeats queue up
            time.sleep(2.5)
        resumed = time.monotonic()

        def settled() -> bool:  # sessions ended, or every one heard from since
            now, live = time.monotonic(), server.stats()["sessions"]
            return len(live) < 4 or all(now - s["idle_s"] > resumed + 0.1 for s in live)

        assert wait_for(settled, timeout_s=10)
        assert len(server.stats()["sessions"]) == 4 and not lost
    finally:
        for session in sessions:
            session.close()
        stop.set()
        loop.join(timeout=10)
        server.close()


@pytest.mark.parametrize("lease_s", [1.0, 30.0], ids=["short-lease", "default-lease"])
def test_held_slots_keep_their_hold_timeout_across_a_host_stall(
    monkeypatch: pytest.MonkeyPatch, lease_s: float
) -> None:
    """Found by the host review: a host stalled (frozen, busy) past ``--hold-timeout`` freed the
    slots of ended sessions whose client may still write them the moment it resumed, though it
    had read none of their releases, and a write in flight to a frozen host lands only once it
    resumes. As a session's silence, a hold's time now counts only while the host listens.
    Found by the review of that fix: a stall was told from a busy turn only past a heartbeat
    period (a third of the lease timeout, 10 s by default), so a 2 s stall still freed a hold
    of 1.5 s under the default lease timeout."""
    from torch_kv_tier.remote.server_config import ServerConfig

    config = ServerConfig(
        num_blocks=32, block_len=BLOCK_LEN, lease_timeout_s=lease_s, hold_timeout_s=1.5
    )
    server = Server(config)
    expiries: list[float] = []  # the times the loop checked the holds at (its lock held)
    expire = server._control.expire
    monkeypatch.setattr(server._control, "expire", lambda now: expiries.append(now) or expire(now))
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,))
    loop.start()
    try:
        session = fake_session(server.address, slots=4, heartbeat_timeout_s=60)
        session.close(clean=False)  # a write may be in flight: its lease is held
        assert wait_for(lambda: server.stats()["held_blocks"] == 4, timeout_s=10)
        with server._lock:  # the host stalls past the hold timeout
            time.sleep(2.0)
        resumed = time.monotonic()
        assert wait_for(lambda: any(t > resumed for t in expiries), timeout_s=10)
        assert server.stats()["held_blocks"] == 4  # the stall did not count against the hold
        assert wait_for(lambda: server.stats()["held_blocks"] == 0, timeout_s=10)  # then it does
    finally:
        stop.set()
        loop.join(timeout=10)
        server.close()


def test_a_dead_clients_session_expires_while_the_host_is_busy_but_keeps_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the host review: a host answering slowly (3 ms a message) in long batches that
    read its socket empty counted each whole batch as a stall (``read no control message``),
    so a dead client's session was charged almost none of its silence: with disk I/O in
    flight (the loop's 0.5 ms poll) it lived on 24 s past a 1 s lease timeout. A batch that
    reads every queued message is the host listening."""
    from torch_kv_tier.remote import server as server_module
    from torch_kv_tier.remote.server_config import ServerConfig

    monkeypatch.setattr(server_module, "IDLE_POLL_S", server_module.DISK_POLL_S)
    server = Server(ServerConfig(num_blocks=32, block_len=BLOCK_LEN, lease_timeout_s=1.0))
    answer = server._control.answer

    def slow_answer(*args: Any) -> Any:
        time.sleep(0.003)
        return answer(*args)

    monkeypatch.setattr(server._control, "answer", slow_answer)
    stop, done = threading.Event(), threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,))
    loop.start()
    opened: list[Any] = []

    def bursts(busy: Any) -> None:  # ~0.4 s of answers each; the host then reads all of it
        while not done.is_set():
            asked = [
                busy._call_async(lambda seq: p.StatsRequest(seq, busy.session_id))
                for _ in range(120)
            ]
            for future in asked:
                future.result(timeout=30)
            done.wait(0.02)

    load = threading.Thread(target=lambda: bursts(opened[0]))
    try:
        opened.append(fake_session(server.address, slots=4, heartbeat_timeout_s=60))
        opened.append(dead := fake_session(server.address, slots=4, heartbeat_timeout_s=60))
        dead._interval_s = 1e6  # its client went silent after its first heartbeat
        load.start()
        assert wait_for(lambda: len(server.stats()["sessions"]) < 2, timeout_s=6)
        assert [s["public_id"] for s in server.stats()["sessions"]] == [opened[0].public_id]
    finally:
        done.set()
        if load.is_alive():
            load.join(timeout=30)
        for session in opened:
            session.close()
        stop.set()
        loop.join(timeout=10)
        server.close()


def test_a_lease_timeout_of_years_still_binds_its_port() -> None:
    """The host pings silent connections every lease timeout: one longer than ZeroMQ's option
    holds is capped, not an ``OverflowError`` at start."""
    Server._bind("127.0.0.1", 0, 1e8).close(linger=0)


def test_client_notices_a_dead_frozen_or_restarted_server() -> None:
    port = free_port()
    lost: dict[str, float] = {}

    def on_lost(session_name: str) -> Any:
        def record(peer_id: str) -> None:
            assert session_name not in lost  # called once
            lost[session_name] = time.monotonic()

        return record

    first = ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)])
    try:
        dead = fake_session(first.address, slots=8, on_lost=on_lost("dead"), heartbeat_timeout_s=60)
    finally:
        first.kill()
    # a dead server's connection closes: noticed at once, not after the 60 s heartbeat timeout
    # (bounded by that timeout: a ceiling of 3 s was one a loaded machine can exceed)
    assert wait_for(lambda: "dead" in lost, timeout_s=30)
    assert dead.lost is not None and "closed or reset" in dead.lost
    with pytest.raises(ConnectionError, match="lost"):
        dead.stats()
    dead.close()
    with ServerProcess.start(32, BLOCK_LEN, extra_args=["--port", str(port)]) as second:
        frozen = fake_session(
            second.address,
            slots=8,
            on_lost=on_lost("frozen"),
            heartbeat_interval_s=0.2,
            heartbeat_timeout_s=2,
        )
        asked = time.monotonic()
        # answered in order, after every heartbeat sent before it: the oldest heartbeat left
        # unanswered went out after ``asked`` (however long a loaded machine took before)
        frozen.stats()
        os.kill(second.proc.pid, signal.SIGSTOP)  # the connection stays up: heartbeats tell
        stopped = time.monotonic()
        try:
            assert wait_for(lambda: "frozen" in lost, timeout_s=10)
        finally:
            os.kill(second.proc.pid, signal.SIGCONT)
        assert lost["frozen"] - asked >= 2.0  # not before the heartbeat timeout
        assert lost["frozen"] - stopped < 5.0
        assert frozen.lost is not None and "no heartbeat answer" in frozen.lost
        frozen.close()


def test_refuses_non_loopback_without_token_and_a_busy_port_saying_why(
    open_server: ServerProcess,
) -> None:
    with pytest.raises(RuntimeError) as info:
        ServerProcess.start(8, BLOCK_LEN, host="0.0.0.0")
    assert "code 2" in str(info.value)
    assert "refusing to listen on 0.0.0.0 without a token" in str(info.value)
    busy_port = open_server.address.rsplit(":", 1)[1]
    with pytest.raises(RuntimeError) as info:
        ServerProcess.start(8, BLOCK_LEN, extra_args=["--port", busy_port])
    assert "code 1" in str(info.value)
    assert f"cannot listen on tcp://127.0.0.1:{busy_port}" in str(info.value)


# -- helpers ---------------------------------------------------------------------------------


def _exchange(address: str, frames: list[bytes], wait_s: float = 5.0) -> p.ServerMessage | None:
    """Send one (multi-part) message from a fresh DEALER; the decoded reply, or ``None``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart(frames)
        if not sock.poll(int(wait_s * 1e3)):
            return None
        return p.decode_server(sock.recv())
    finally:
        sock.close(linger=0)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_a_metrics_scrape_during_start_up_gets_the_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics port serves from the start; a scrape that comes while the pool is still being
    made waits for it and answers the whole stats, not an error."""
    from torch_kv_tier.remote import server as server_module
    from torch_kv_tier.remote.server_config import ServerConfig

    port = free_port()
    answers: list[str | BaseException] = []

    def scrape() -> None:
        try:
            answers.append(_metrics(port))
        except BaseException as exc:
            answers.append(exc)

    scraper = threading.Thread(target=scrape)
    make_pool = server_module.make_pool

    def slow_pool(num_blocks: int, block_len: int) -> Any:
        scraper.start()  # the metrics server is up; the control plane is not built yet
        time.sleep(0.3)
        return make_pool(num_blocks, block_len)

    monkeypatch.setattr(server_module, "make_pool", slow_pool)
    server = server_module.Server(
        ServerConfig(num_blocks=8, block_len=BLOCK_LEN, metrics_port=port)
    )
    try:
        scraper.join(timeout=10)
        assert len(answers) == 1 and isinstance(answers[0], str), answers
        assert "torch_kv_tier_server_sessions 0\n" in answers[0]
    finally:
        server.close()


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
    from torch_kv_tier.remote.server import Server
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


def test_a_serving_hosts_index_is_out_of_the_garbage_collectors_reach() -> None:
    """Found by review: a full collection traversed the host's index, millions of keys, in
    the loop: 0.23 s per million keys in DRAM and on disk (1 s at 4 M), every tier's control
    plane stalled meanwhile. The loop freezes the index's containers when it starts and a
    namespace's entries once it is made, so a collection no longer walks them."""
    import gc

    from torch_kv_tier.remote.server import Server
    from torch_kv_tier.remote.server_config import ServerConfig

    def tracked(obj: object) -> bool:
        return any(o is obj for o in gc.get_objects())

    server = Server(ServerConfig(num_blocks=32, block_len=BLOCK_LEN))
    try:
        cache = server._control.shared.cache
        stop = mock.Mock(spec=threading.Event)
        stop.is_set.side_effect = [False, True]  # one turn of the loop
        server.serve(stop, freeze_index=True)  # as `torch-kv-tier serve` does
        assert not tracked(cache._lru) and not tracked(cache._owners.pairs)
        cache.join("s", "ns")  # as a handshake does
        entries = cache.namespace_of("s").entries
        entries[b"k"] = 0
        assert tracked(entries)
        server._freeze_index()  # the loop's next turn
        assert not tracked(entries)
    finally:
        gc.unfreeze()
        server.close()
