"""A peer dropped after a remote disconnect (its UCX endpoint failed) has its remote agent
removed, not parked (``nixl_peers``): loaded again from the same metadata, a parked agent came
back with its failed endpoint, and every post to that host failed for good."""

from __future__ import annotations

import subprocess
import time
from contextlib import closing

import psutil
import pytest
from remote_peer import RemotePeer
from test_transport import drain, random_blocks

from torch_kv_tier.transport import NixlTransport, agent_lifetime

BLOCK = 4096


def reset_sockets(pid: int) -> None:
    """``ss -K`` both ends of every TCP connection of process ``pid`` (UCX's included)."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.raddr}
    assert ports, "the peer has no TCP connection to reset"
    for port in ports:
        for side in ("sport", "dport"):
            subprocess.run(["ss", "-K", "-t", f"{side} = :{port}"], check=True, timeout=10)


def test_a_host_whose_endpoint_was_reset_is_usable_again_once_dropped_and_dialled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX over TCP, the host's sockets reset while it lives (``ss -K``): the transport faults
    the peer and the tier drops it (``drop_remote_peer``), then dials it again. The dropped
    peer's agent was parked and loaded again, failed endpoint and all: every later write to
    the host failed with a remote disconnect. Now the re-registration loads a fresh agent and
    the write lands."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setattr(agent_lifetime, "keep_until_exit", lambda agent, name: None)
    with (
        RemotePeer(8, BLOCK, env={"UCX_TLS": "tcp"}) as host,
        closing(NixlTransport("redial", random_blocks(8, seed=3), passive_progress=False)) as t,
    ):
        t.add_remote_peer("h", *host.peer_args())
        tid = t.write_blocks("h", [0], [0])
        assert drain(t, {tid})[0] == {tid}  # type: ignore[arg-type]
        reset_sockets(host.process.pid)
        deadline = time.monotonic() + 10
        while "h" not in t.faulted_peers():  # what the tier does until the peer faults
            assert time.monotonic() < deadline, "the reset never faulted the peer"
            tid = t.write_blocks("h", [1], [1])
            if tid is not None:
                drain(t, {tid}, peer_id="h")
        assert t.faulted_peers()["h"] == "NIXL_ERR_REMOTE_DISCONNECT"
        t.drop_remote_peer("h")  # the tier's drop of a lost host
        t.add_remote_peer("h", *host.peer_args())  # dialled again: the same process
        tid = t.write_blocks("h", [2], [2])
        assert tid is not None and drain(t, {tid}, peer_id="h") == ({tid}, set())
        assert t.faulted_peers() == {}
        assert bool((host.get([2]) == t.region.owner[2]).all())
