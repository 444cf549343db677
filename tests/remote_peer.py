"""A NIXL target in another process: what a remote host looks like to a transport under test.

The child owns a ``num_blocks x block_len`` host region registered by a ``NixlTransport`` built
with defaults, and answers ``get``/``set`` of whole blocks over a pipe so tests can check the bytes
that really landed there. Nothing else is ever called on that transport: it serves incoming
transfers passively, as a vLLM-style peer does.

Peers start from a fork server that has imported this module (torch, which NIXL's Python API
imports too, and the project's transport code, which loads no NIXL at import): a fresh process
per peer, as with ``spawn``, without paying about 2 s of imports each time. NIXL and UCX are
loaded in the child, after its environment is set.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import torch

from torch_kv_tier.benchmarks.reliability_common import stop_process


def _serve(conn: Connection, num_blocks: int, block_len: int, env: dict[str, str]) -> None:
    os.environ.clear()  # the environment of the test that started it, not of the fork server
    os.environ.update(env)
    from torch_kv_tier.transport import NixlTransport

    region = torch.zeros(num_blocks, block_len, dtype=torch.uint8)
    transport = NixlTransport("peer", region)
    conn.send((transport.get_agent_metadata(), transport.base_addr, num_blocks, block_len))
    while True:
        cmd, args = conn.recv()
        if cmd == "get":
            conn.send(region[list(args)].clone())
        elif cmd == "set":
            idxs, data = args
            region[list(idxs)] = data
            conn.send(None)
        else:
            break
    transport.close()
    conn.send("closed")


_CONTEXT = mp.get_context("forkserver")
# What this module imports, not the module itself: the fork server cannot import ``remote_peer``
# (Python 3.11's ignores the sys.path it is handed, and tests/ is not on its own) and skips a
# preload it cannot import without a word, so every peer imported torch itself.
_CONTEXT.set_forkserver_preload(
    ["torch", "torch_kv_tier.benchmarks.reliability_common", "torch_kv_tier.transport"]
)


class RemotePeer:
    """Handle on a peer process; use as a context manager."""

    def __init__(self, num_blocks: int, block_len: int, env: dict[str, str] | None = None) -> None:
        ctx = _CONTEXT
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve,
            args=(child, num_blocks, block_len, {**os.environ, **(env or {})}),
            daemon=True,
        )
        self.process.start()
        if not self._conn.poll(60):
            self.kill()
            raise TimeoutError("peer process did not start within 60 s")
        self.agent_metadata, self.base_addr, self.num_blocks, self.block_len = self._conn.recv()

    def peer_args(self) -> tuple[bytes, int, int, int]:
        """Arguments for ``add_remote_peer`` after the peer id."""
        return self.agent_metadata, self.base_addr, self.num_blocks, self.block_len

    def _call(self, cmd: str, args: Any) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(30):
            raise TimeoutError(f"peer did not answer {cmd!r} within 30 s")
        return self._conn.recv()

    def get(self, idxs: list[int]) -> torch.Tensor:
        """The bytes of the given blocks as they are in the peer's memory now."""
        return self._call("get", idxs)

    def set(self, idxs: list[int], data: torch.Tensor) -> None:
        """Overwrite the given blocks in the peer's memory."""
        self._call("set", (idxs, data))

    def signal(self, signum: int) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signum)

    def stop(self) -> None:
        """SIGSTOP the peer; returns once all its threads are stopped."""
        assert self.process.pid is not None
        stop_process(self.process.pid)

    def kill(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGKILL)
        self.process.join(timeout=10)

    def close(self) -> None:
        """Stop the peer cleanly (its transport closes) or kill it if it does not answer."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self._call("stop", None)
            self.process.join(timeout=10)
        self.kill()

    def __enter__(self) -> RemotePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
