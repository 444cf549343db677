"""``torch-kv-tier serve``'s liveness: a killed, frozen or dead client's lease and connection,
sessions across a host's stall, a client noticing a dead, frozen or restarted host."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import pytest
import zmq
from remote_server_support import module_open_server
from remote_support import (
    BLOCK_LEN,
    control_ports,
    fake_session,
    free_port,
    wait_for,
)

from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.remote import HandshakeRejected, ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.server import Server

open_server = module_open_server()


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
