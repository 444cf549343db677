"""``torch-kv-tier digest-cost --device cuda``: where a CUDA arena's block digests spend time.

A tier whose arena is on the GPU digests each call's blocks on the host
(``torch_kv_tier.digest.BlockDigests``: a gather on the device, a copy into the calling thread's
pinned staging buffer, then xxh3 per block). Until it staged through pinned memory it copied
into pageable memory (``.cpu()``), and on an H200 the tier with digests took 1.5 to 2.2 ms more
per 2 MiB block than without in ``torch-kv-tier bench --device cuda``; this showed why (a
pageable copy of 16 such blocks ran at 1.6 GB/s, a pinned one at 50 GB/s). This times, per block
size, on calls of 16 blocks walked in order through the arena:

- ``digest``: ``BlockDigests.of`` on the CUDA arena, all of it;
- ``digest_pageable``: the same digests through a copy into pageable memory (the earlier way);
- ``d2h``: the gather and copy to pageable host memory alone;
- ``d2h_pinned``: the gather and a copy into one reused pinned host buffer alone.

Rounds interleave the functions in alternating order; each figure is GB/s over wall time (the
copy is the GPU's and the driver's time, not this thread's CPU), median over rounds with its
IQR and min..max.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torch_kv_tier.benchmarks.digest_cost import BATCH, _label, _spread, interleave
from torch_kv_tier.digest import BlockDigests

FUNCTIONS = ("digest", "digest_pageable", "d2h", "d2h_pinned")


class _Cell:
    """One (block size, function) over the CUDA arena: runs calls for a while; records GB/s."""

    def __init__(self, arena: torch.Tensor, block_len: int, function: str) -> None:
        self.block_len, self.function = block_len, function
        self._blocks = arena[: arena.numel() // block_len * block_len].view(-1, block_len)
        n = self._blocks.shape[0] // BATCH * BATCH
        if n == 0:
            raise ValueError(f"the arena holds fewer than {BATCH} blocks of {block_len} bytes")
        self._calls = [list(range(i, i + BATCH)) for i in range(0, n, BATCH)]
        self._keys = [[block_len + i for i in call] for call in self._calls]
        self._next = 0
        self._digests = BlockDigests(self._blocks)
        self._pinned = torch.empty((BATCH, block_len), dtype=torch.uint8, pin_memory=True)
        self.gbps: list[float] = []

    def _call(self) -> None:
        i = self._next
        self._next = (i + 1) % len(self._calls)
        call = self._calls[i]
        if self.function == "digest":
            self._digests.of(call, self._keys[i])
        elif self.function == "digest_pageable":
            BlockDigests(self._blocks[call].cpu()).of(range(BATCH), self._keys[i])
        elif self.function == "d2h":
            self._blocks[call].cpu()
        else:
            self._pinned.copy_(self._blocks[call])  # synchronous: the host reads it next

    def measure(self, min_time: float) -> None:
        """One round: calls for at least ``min_time`` seconds."""
        torch.cuda.synchronize(self._blocks.device)
        calls, wall0 = 0, time.perf_counter()
        while True:
            self._call()
            calls += 1
            wall = time.perf_counter() - wall0
            if wall >= min_time:
                break
        self.gbps.append(calls * BATCH * self.block_len / wall / 1e9)

    def reset(self) -> None:
        self.gbps.clear()


def measure(
    block_sizes: list[int], arena_mib: int, rounds: int, min_time: float, device: str
) -> list[dict[str, Any]]:
    """One row per (block size, function): ``gbps_wall`` (median, IQR, min..max over
    ``rounds``) and the per-round figures. Raises ``ValueError`` if the arena is too small."""
    arena = torch.full((arena_mib << 20,), 0xA5, dtype=torch.uint8, device=device)
    cells = [_Cell(arena, bl, fn) for bl in block_sizes for fn in FUNCTIONS]
    interleave(cells, rounds, min_time)
    return [
        {
            "block_len": c.block_len,
            "place": "gpu",
            "function": c.function,
            "gbps_wall": _spread(c.gbps),
            "gbps_wall_rounds": [round(x, 3) for x in c.gbps],
        }
        for c in cells
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """One line per block size: wall GB/s of each function."""
    by = {(r["block_len"], r["function"]): r["gbps_wall"] for r in rows}
    lines = [
        "| block | " + " | ".join(f"{f} GB/s wall (IQR; min..max)" for f in FUNCTIONS) + " |",
        "|---|" + "---|" * len(FUNCTIONS),
    ]
    for bl in dict.fromkeys(r["block_len"] for r in rows):
        cells = []
        for fn in FUNCTIONS:
            s = by[(bl, fn)]
            cells.append(f"{s['median']:.2f} ({s['q1']:.2f}-{s['q3']:.2f}; "
                         f"{s['min']:.2f}..{s['max']:.2f})")  # fmt: skip
        lines.append(f"| {_label(bl)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
