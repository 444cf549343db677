"""``memcpy``: a torch copy between the local arena and a second host tensor, the ceiling.

On CPU both tensors are host memory and each call copies synchronously. On CUDA the local arena
is on the GPU and the "remote" tensor is pinned host memory: each call is a pinned D2H (write) or
H2D (read) copy on a side stream, completed by a CUDA event, so in-flight depth means the same
as for the transfer systems. Runs contiguous on both sides are copied as one range (the merging
NIXL does), so scattered calls cost what a careful copy loop costs. Host copies run on one
thread (torch's intra-op threads are set to 1 while the system is open): a UCX shared-memory copy
is one thread too, and on a small busy machine a two-thread copy stalls on its slower half.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import torch

from torch_kv_tier.benchmarks.core import Call, Op, System
from torch_kv_tier.benchmarks.remote import Target
from torch_kv_tier.benchmarks.system_nixl_raw import local_arena


class Memcpy(System):
    """Copies between ``local`` and a host tensor of ``remote_slots`` blocks (no network)."""

    name = "memcpy"
    remote_layout = "mirror"

    def __init__(self, target: Target) -> None:
        self.local = local_arena(target, pinned=False)
        cuda = self.local.is_cuda
        self.path = "d2h" if cuda else "host"
        self.remote_slots = target.remote_slots
        self._remote = torch.zeros(
            (target.remote_slots, target.block_len), dtype=torch.uint8, pin_memory=cuda
        )
        self._stream: Any = torch.cuda.Stream(self.local.device) if cuda else None
        self._pending: dict[int, Any] = {}
        self._finished: list[tuple[Hashable, float]] = []
        self._ids = 0
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def _copy(self, op: Op, call: Call) -> None:
        for lo, ro, n in call.spans:
            src, dst = self.local[lo : lo + n], self._remote[ro : ro + n]
            if op == "read":
                src, dst = dst, src
            dst.copy_(src, non_blocking=self._stream is not None)

    def submit(self, op: Op, call: Call) -> Hashable:
        self._ids += 1
        if self._stream is None:
            self._copy(op, call)
            self._finished.append((self._ids, time.perf_counter()))
            return self._ids
        with torch.cuda.stream(self._stream):
            self._copy(op, call)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending[self._ids] = event
        return self._ids

    def reap(self, timeout: float) -> list[tuple[Hashable, float]]:
        out, self._finished = self._finished, []
        for tid, event in list(self._pending.items()):
            if event.query():
                out.append((tid, time.perf_counter()))
                del self._pending[tid]
        return out

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._pending.clear()
        torch.set_num_threads(self._threads)
