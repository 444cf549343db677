"""Helpers shared by the ``test_remote_*`` files: clients of a ``torch-kv-tier serve`` child."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch

from torch_kv_tier.benchmarks.reliability_common import wait_until as wait_for  # noqa: F401  (re-exported)
from torch_kv_tier.remote import Region, RemoteSession
from torch_kv_tier.transport import NixlTransport

BLOCK_LEN = 4096
TOKEN = "remote-test-token-5f0c1e"
RESULT_TIMEOUT_S = 20.0  # how long the control-plane tests wait for one result of a tier


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run iproute2's ``ip`` with ``args`` (10 s at most); raises on failure when ``check``."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def fake_session(
    address: str, *, block_len: int = BLOCK_LEN, private: bool = True, **kwargs: Any
) -> RemoteSession:
    """A session without a NIXL agent: enough for everything but moving bytes. Private (a
    lease) unless asked otherwise: most control-plane tests are about leases."""
    return RemoteSession.open(
        address,
        agent_metadata=b"not a nixl agent",
        region=Region(0x10000, 8, block_len),
        timeout_s=kwargs.pop("timeout_s", 10.0),
        private=private,
        **kwargs,
    )


class Client:
    """A NIXL transport over ``num_blocks`` random local blocks, plus its session."""

    def __init__(self, address: str, num_blocks: int, **kwargs: Any) -> None:
        self.blocks = torch.randint(0, 256, (num_blocks, BLOCK_LEN), dtype=torch.uint8)
        self.transport = NixlTransport("remote-test", self.blocks)
        try:
            self.session = RemoteSession.open(
                address,
                agent_metadata=self.transport.get_agent_metadata(),
                region=Region(self.transport.base_addr, num_blocks, BLOCK_LEN),
                config_fingerprint=self.transport.config_fingerprint,
                **kwargs,
            )
            s = self.session
            self.transport.add_remote_peer(
                s.peer_id, s.agent_metadata, s.base_addr, s.num_blocks, s.block_len
            )
        except BaseException:
            self.transport.close()
            raise

    def move(self, op: str, local: Sequence[int], remote: Sequence[int]) -> None:
        """``write``/``read`` blocks to/from the server and wait (10 s) until done."""
        submit = self.transport.write_blocks if op == "write" else self.transport.read_blocks
        tid = submit(self.session.peer_id, local, remote)
        assert tid is not None, f"{op} submission failed"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            result = self.transport.poll()
            assert tid not in result.failed, f"{op} failed"
            if tid in result.done:
                return
            time.sleep(0.001)
        raise TimeoutError(f"{op} of {len(local)} blocks not done in 10 s")

    def close(self) -> None:
        self.session.close()
        self.transport.close()


def fill_random(tier: Any) -> torch.Tensor:
    """Random bytes in every block of a tier's arena; returns a copy of them."""
    tier.arena.tensor.copy_(torch.randint(0, 256, tier.arena.tensor.shape, dtype=torch.uint8))
    return tier.arena.tensor.clone()


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` every 10 ms until it is true; after ``timeout`` s, fail the test with
    an ``AssertionError`` saying it timed out waiting until ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting until {what}"
        time.sleep(0.01)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def control_ports(server: Any, process: psutil.Process | None = None) -> set[int]:
    """The local ports of the established control connections of ``process`` (default: this
    one) to ``server`` (a ``ServerProcess``), to reset one with ``ss -K``."""
    port = int(server.address.rsplit(":", 1)[1])
    return {
        c.laddr.port
        for c in (process or psutil.Process()).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


class SilentHosts:
    """``n`` listening sockets on ``host`` that accept TCP connections (the kernel does) and
    never answer: hosts that are up but never answer a handshake. Close with ``close``."""

    def __init__(self, n: int, host: str = "127.0.0.1") -> None:
        self._listeners = []
        for _ in range(n):
            listener = socket.socket()
            listener.bind((host, 0))
            listener.listen(8)
            self._listeners.append(listener)
        self.addresses = [f"{host}:{s.getsockname()[1]}" for s in self._listeners]
        self._accepted: list[socket.socket] = []

    def dialled_side_by_side(self, within: float, first_timeout: float = 60.0) -> bool:
        """Whether, once one host has a connection (in ``first_timeout`` s), every other one has
        one within ``within`` s, and none of them was closed yet: dialled side by side, not each
        once the one before it gave up (``within`` below the handshake's timeout)."""
        deadline = time.monotonic() + first_timeout
        for listener in self._listeners:
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                self._accepted.append(listener.accept()[0])
            except TimeoutError:
                return False
            if len(self._accepted) == 1:
                deadline = time.monotonic() + within
        return all(_still_open(conn) for conn in self._accepted)

    def close(self) -> None:
        for s in [*self._accepted, *self._listeners]:
            s.close()


def _still_open(conn: socket.socket) -> bool:
    """Whether the peer has not closed ``conn`` (what it sent is read and dropped)."""
    conn.setblocking(False)
    try:
        while conn.recv(4096):
            pass
    except BlockingIOError:
        return True
    except ConnectionError:
        return False
    return False
