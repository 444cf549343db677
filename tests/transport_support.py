"""What the NixlTransport tests share (and other tests that drive a real NIXL transport): random
blocks of ``BLOCK`` bytes, polling a transport until its transfers are reported, and a real NIXL
agent whose chosen calls raise."""

from __future__ import annotations

import time
from typing import Any

import torch

from torch_kv_tier.transport import NixlTransport

BLOCK = 4096


def random_blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def drain(t: NixlTransport, ids: set[int], timeout: float = 10.0, peer_id: str | None = None):
    """Poll until every id in ``ids`` is reported; return (done, failed) sets."""
    done: set[int] = set()
    failed: set[int] = set()
    deadline = time.monotonic() + timeout
    while not ids <= done | failed:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reported within {timeout} s: {ids - done - failed}")
        result = t.poll(peer_id)
        assert not (set(result.done) | set(result.failed)) & (done | failed), "reported twice"
        done.update(result.done)
        failed.update(result.failed)
    return done, failed


class FaultyAgent:
    """Real NIXL agent with chosen calls made to raise (fault injection on top of real NIXL)."""

    def __init__(self, agent: Any, fail: set[str]) -> None:
        self._agent = agent
        self.fail = fail
        self.calls: dict[str, int] = {}
        self.released: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._agent, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "release_xfer_handle":
                self.released.append(args[0])
            if name in self.fail:
                raise RuntimeError(f"injected {name} failure")
            return real(*args, **kwargs)

        return call
