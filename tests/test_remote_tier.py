"""A ``TierManager`` against ``torch-kv-tier serve`` children: round trips, a dying server,
and a server in its own network namespace (the closest this machine gets to two hosts)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from remote_support import BLOCK_LEN, TOKEN, fill_random, ip, wait_for

from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

RESULT_TIMEOUT_S = 20.0


def test_500_random_blocks_round_trip_through_a_server() -> None:
    with (
        ServerProcess.start(1024, BLOCK_LEN) as server,
        TierManager.create(512, BLOCK_LEN, name="roundtrip") as tier,
    ):
        peer_id = tier.connect(server.address)
        assert tier.peers() == [peer_id]
        local = torch.randperm(512)[:500].tolist()
        keys = [f"block-{i}".encode() for i in range(500)]
        original = fill_random(tier)
        stored = tier.store(keys, local).result(timeout=RESULT_TIMEOUT_S)
        assert stored.ok, stored.failed
        assert tier.lookup(keys) == 500
        tier.arena.tensor.zero_()
        order = torch.randperm(500).tolist()  # load in another order into other blocks
        targets = [local[i] for i in order]
        loaded = tier.load([keys[i] for i in order], targets).result(timeout=RESULT_TIMEOUT_S)
        assert loaded.ok, loaded.failed
        assert torch.equal(tier.arena.tensor[targets], original[targets])
        tier.disconnect(peer_id)
        assert tier.peers() == []


def test_server_killed_mid_transfer_fails_its_futures_and_another_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # really in flight: shared memory finishes at once
    with (
        ServerProcess.start(256, BLOCK_LEN) as doomed,
        ServerProcess.start(256, BLOCK_LEN) as survivor,
        TierManager.create(512, BLOCK_LEN, name="killtest", events=True) as tier,
    ):
        dead_peer = tier.connect(doomed.address)
        live_peer = tier.connect(survivor.address)
        original = fill_random(tier)
        keys = [f"k{i}" for i in range(400)]
        first = tier.store(keys[:200], range(200)).result(timeout=RESULT_TIMEOUT_S)
        assert first.ok, first.failed
        tier.take_events()

        stop_process(doomed.proc.pid)  # frozen: its transfers stay in flight
        pending = [tier.store(keys[200:], range(200, 400)), tier.load(keys[:200], range(200))]
        time.sleep(0.3)
        assert not all(f.done() for f in pending)
        doomed.kill()
        killed = time.monotonic()
        results = [f.result(timeout=RESULT_TIMEOUT_S) for f in pending]
        settled_after = time.monotonic() - killed

        assert settled_after < 10.0 + 2.0  # within the heartbeat timeout (10 s) plus slack
        assert wait_for(lambda: tier.peers() == [live_peer], timeout_s=12.0)

        # keys homed on the dead server failed; the rest arrived intact
        failed = {k: r for res in results for k, r in res.failed.items()}
        assert failed, "the killed server's keys must fail"
        assert set(failed.values()) <= {"peer lost", "transfer failed"}
        loaded_ok = [k for k in results[1].keys]
        idx = [keys.index(k) for k in loaded_ok]
        assert torch.equal(tier.arena.tensor[idx], original[idx])
        assert any(e.kind == "lost" and e.peer_id == dead_peer for e in tier.take_events())

        # the surviving server takes everything now
        tier.arena.tensor.copy_(original)
        fresh = [f"fresh{i}" for i in range(100)]
        again = tier.store(fresh, range(100, 200)).result(timeout=RESULT_TIMEOUT_S)
        assert again.ok, again.failed
        tier.arena.tensor[100:200].zero_()
        back = tier.load(fresh, range(100, 200)).result(timeout=RESULT_TIMEOUT_S)
        assert back.ok, back.failed
        assert torch.equal(tier.arena.tensor[100:200], original[100:200])


# -- off loopback: the server in its own network namespace -----------------------------------


@contextlib.contextmanager
def _namespace_with_veth() -> Iterator[tuple[str, str, str, str]]:
    """A fresh namespace joined to this one by a veth pair; removed on exit, even on failure.

    Yields (namespace, host-side veth, namespace-side veth, namespace-side address).
    """
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = f"{os.getpid() % 100000}"
    ns, host_if, ns_if = f"tkvt{tag}", f"tkvth{tag}", f"tkvtn{tag}"
    octet = 16 + os.getpid() % 200
    host_addr, ns_addr = f"10.213.{octet}.1", f"10.213.{octet}.2"
    try:
        try:
            ip("netns", "add", ns)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create a network namespace (needs root): {exc.stderr.strip()}")
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        for cmd in (
            ("addr", "add", f"{ns_addr}/30", "dev", ns_if),
            ("link", "set", ns_if, "up"),
            ("link", "set", "lo", "up"),
        ):
            ip("netns", "exec", ns, "ip", *cmd)
        yield ns, host_if, ns_if, ns_addr
    finally:
        ip("netns", "del", ns, check=False)  # takes the veth pair with it
        ip("link", "del", host_if, check=False)


# The tier runs in a fresh process: UCX in a process that started before the veth existed
# does not see the new interface ("failed to create ep").
_NETNS_CLIENT = """
import sys
import torch
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import HandshakeRejected

address, token, block_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
with TierManager.create(128, block_len, name="netns") as tier:
    try:
        tier.connect(address, token="wrong")
        raise SystemExit("a wrong token was accepted")
    except HandshakeRejected as exc:
        assert exc.reason == "bad token", exc.reason
    peer_id = tier.connect(address, token=token)
    original = torch.randint(0, 256, tier.arena.tensor.shape, dtype=torch.uint8)
    tier.arena.tensor.copy_(original)
    keys = list(range(128))
    stored = tier.store(keys, keys).result(timeout=20)
    assert stored.ok, stored.failed
    tier.arena.tensor.zero_()
    loaded = tier.load(keys, keys).result(timeout=20)
    assert loaded.ok, loaded.failed
    assert torch.equal(tier.arena.tensor, original), "bytes differ after the round trip"
    tier.disconnect(peer_id)
print("round trip ok")
"""


def test_tier_reaches_a_server_in_another_network_namespace(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    # UCX over TCP on the veth pair only: nothing leaves this machine
    with (
        _namespace_with_veth() as (ns, host_if, ns_if, ns_addr),
        ServerProcess.start(
            256,
            BLOCK_LEN,
            host=ns_addr,
            token_file=str(token_file),
            env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": ns_if},
            prefix=["ip", "netns", "exec", ns],
        ) as server,
    ):
        assert server.address == f"{ns_addr}:{server.address.rsplit(':', 1)[1]}"
        client = subprocess.run(
            [sys.executable, "-c", _NETNS_CLIENT, server.address, TOKEN, str(BLOCK_LEN)],
            env={**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": host_if},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        assert client.stdout.strip() == "round trip ok"
        assert server.stop() == 0, server.stderr
