"""A peer dropped after a remote disconnect (its UCX endpoint failed) has its remote agent
removed, not parked (``nixl_peers``): loaded again from the same metadata, a parked agent came
back with its failed endpoint, and every post to that host failed for good."""

from __future__ import annotations

import subprocess
import time
from contextlib import closing

import psutil
import pytest
import torch
from remote_peer import RemotePeer
from remote_support import BLOCK_LEN, fill_random, wait_until
from transport_support import drain, random_blocks

from torch_kv_tier.benchmarks.reliability_common import ucx_over_tcp
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.transport import NixlTransport, agent_lifetime

BLOCK = 4096
RESULT_TIMEOUT_S = 20.0


def reset_sockets(pid: int) -> None:
    """``ss -K`` both ends of every TCP connection of process ``pid`` (UCX's included)."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.raddr}
    assert ports, "the peer has no TCP connection to reset"
    for port in ports:
        for side in ("sport", "dport"):
            subprocess.run(["ss", "-K", "-t", f"{side} = :{port}"], check=True, timeout=10)


def tier_connections(host_pid: int, control_port: int) -> list[tuple[int, int]]:
    """(host port, tier port) of each UCX TCP connection between the host and another process:
    not the control port's, nor those between two sockets of the host itself."""
    conns = [
        c
        for c in psutil.Process(host_pid).net_connections("tcp")
        if c.raddr and control_port not in (c.laddr.port, c.raddr.port)
    ]
    own = {c.laddr.port for c in conns}
    return sorted((c.laddr.port, c.raddr.port) for c in conns if c.raddr.port not in own)


def test_one_reset_ucx_connection_faults_the_host_at_a_next_transfer_and_the_tier_recovers() -> (
    None
):
    """One of a live host's UCX TCP connections to a tier reset (``ss -K``, the control port
    untouched) while nothing is in flight: nothing tells the tier until it moves bytes there
    again. Its next stores and loads then resolve (never hang): one may still go through (a
    load then brings the bytes stored), and one fails within a few, after which the tier
    drops the host and dials it again (its first redial backoff), and later stores load back
    the bytes they stored. Either connection of the pair fails the whole endpoint."""
    with (
        ucx_over_tcp(),
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="one-reset") as tier,
    ):
        tier.connect(server.address)
        control = int(server.address.rsplit(":", 1)[1])
        fill_random(tier)
        assert tier.store(["warm"], [0]).result(timeout=RESULT_TIMEOUT_S).ok
        pairs = len(tier_connections(server.proc.pid, control))
        assert pairs, "the tier made no UCX connection to the host"
        for i in range(pairs):  # each connection of a fresh pair (a redial makes new ones)
            host_port, tier_port = tier_connections(server.proc.pid, control)[i]
            subprocess.run(
                ["ss", "-K", "-t", f"sport = :{host_port} and dport = :{tier_port}"],
                check=True,
                timeout=10,
            )
            for attempt in range(20):
                key = f"after-reset-{i}-{attempt}"
                if not tier.store([key], [1]).result(timeout=RESULT_TIMEOUT_S).ok:
                    break
                tier.arena.tensor[2].zero_()
                if not tier.load([key], [2]).result(timeout=RESULT_TIMEOUT_S).ok:
                    break
                assert torch.equal(tier.arena.tensor[2], tier.arena.tensor[1])
            else:
                raise AssertionError("20 round trips after a UCX reset went through: unnoticed")
            wait_until(
                lambda n=i: tier.stats().peers_dropped > n and bool(tier.peers()),
                "the tier dropped the host and dialled it again",
                15.0,
            )
            keys = [f"redialled-{i}-{j}" for j in range(4)]
            assert tier.store(keys, range(4)).result(timeout=RESULT_TIMEOUT_S).ok
            loaded = tier.load(keys, range(4, 8)).result(timeout=RESULT_TIMEOUT_S)
            assert loaded.ok and torch.equal(tier.arena.tensor[4:8], tier.arena.tensor[:4])
        assert tier.stats().peers_dropped == pairs


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
