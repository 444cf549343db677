"""What the benchmark tests share: a fake transport for the poll-scaling benchmark that moves
blocks between in-memory pools and corrupts one remote slot, so the benchmark's verification
has something to catch."""

from __future__ import annotations

import torch


class FakePollTransport:
    """The part of ``NixlTransport`` poll scaling drives, over an in-memory remote pool that
    corrupts one remote slot's last byte on every write to it."""

    def __init__(self, arena: torch.Tensor, remote_blocks: int, corrupt: int) -> None:
        self.arena, self.corrupt = arena, corrupt
        self.remote = torch.zeros(remote_blocks, arena.shape[1], dtype=torch.uint8)
        self.done: list[int] = []
        self.ids = 0

    def _move(self, dst: torch.Tensor, d: int, src: torch.Tensor, s: int) -> int:
        dst[d] = src[s]
        self.ids += 1
        self.done.append(self.ids)
        return self.ids

    def write_blocks(self, peer: str, local: list[int], remote: list[int]) -> int:
        tid = self._move(self.remote, remote[0], self.arena, local[0])
        if remote[0] == self.corrupt:
            self.remote[remote[0], -1] += 1
        return tid

    def read_blocks(self, peer: str, local: list[int], remote: list[int]) -> int:
        return self._move(self.arena, local[0], self.remote, remote[0])

    def poll(self) -> object:
        done, self.done = self.done, []
        return type("Polled", (), {"done": done, "failed": []})()
