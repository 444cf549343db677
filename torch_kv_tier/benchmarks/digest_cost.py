"""``torch-kv-tier digest-cost``: what verification costs, GB/s per core of the block digest.

Every store computes, and every load recomputes, one xxh3-64 digest per block
(``torch_kv_tier.digest.BlockDigests``). This measures that digest on one thread, for each block
size, with the blocks in three places:

- ``cache``: the same few blocks hashed again and again (``max(1, 1 MiB / block)`` blocks): the
  cost when the transfer has just brought the bytes into the CPU caches;
- ``dram``: an arena much larger than the last-level cache (``--arena-mib``, default 2 GiB),
  walked once per round in order, so each block comes from memory;
- ``busy``: the ``cache`` blocks again, while another Python thread of the process spins: what
  a digest costs beside a busy thread (see ``torch_kv_tier.digest`` on the GIL). Read its wall
  GB/s: its per-core figure leaves out the time spent waiting for the GIL.

Two functions per place: ``digest`` is ``BlockDigests.of`` on calls of 16 blocks (what a store
or load pays: the per-key seed and the Python around the C call included), ``xxh3`` the bare
``xxhash.xxh3_64_intdigest`` over the same blocks (the floor). Rounds interleave every (size,
place, function) cell in alternating order; each cell's figure is the median over rounds with
its IQR and min..max. GB/s is computed twice: over the thread's CPU time (``per core``: what a
core delivers, robust to other processes on the machine) and over wall time.

``--device cuda`` times a CUDA arena's digests instead (``digest_gpu``: the whole digest, its
copy to host memory, and that copy into pinned memory).

Exit status 0; 2 for bad arguments (``--device cuda`` without CUDA among them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from torch_kv_tier.benchmarks import options
from torch_kv_tier.benchmarks.options import list_of, positive, size, usable_cpus
from torch_kv_tier.digest import BlockDigests
from torch_kv_tier.keys import Key

BATCH = 16  # blocks per ``BlockDigests.of`` call, as one tier call of 16 blocks
HOT_BYTES = 1 << 20  # the cache-resident set: this many bytes of blocks (at least one block)
PLACES = ("cache", "dram", "busy")
FUNCTIONS = ("digest", "xxh3")
DEFAULTS: dict[str, Any] = {
    "block_sizes": [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20],
    "arena_mib": 2048,
    "rounds": 7,
    "min_time": 0.1,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``digest-cost`` options to ``parser``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    options.add_preset_options(
        parser,
        [
            ("--block-sizes", list_of(size), "bytes per block", "B"),
            ("--arena-mib", positive, "DRAM-resident arena", "MiB"),
            ("--rounds", positive, "interleaved rounds", ""),
            ("--min-time", options.duration, "least time per cache-resident cell and round", "s"),
        ],
        DEFAULTS,
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda[:n]: a CUDA arena's digests"
    )
    options.add_output_option(parser, "--json", "every figure")


class _Cell:
    """One (block size, place, function): hashes its blocks; records bytes and seconds."""

    def __init__(self, arena: torch.Tensor, block_len: int, place: str, function: str) -> None:
        self.block_len, self.place, self.function = block_len, place, function
        blocks = arena[: arena.numel() // block_len * block_len].view(-1, block_len)
        if place != "dram":
            blocks = blocks[: max(1, HOT_BYTES // block_len)]
        n = blocks.shape[0] // BATCH * BATCH if blocks.shape[0] >= BATCH else blocks.shape[0]
        self.calls = [list(range(i, min(i + BATCH, n))) for i in range(0, n, BATCH)]
        self.keys: list[list[Key]] = [[block_len + i for i in call] for call in self.calls]
        self._digests = BlockDigests(blocks)
        self._rows = list(blocks.numpy())
        self.cpu_gbps: list[float] = []
        self.wall_gbps: list[float] = []

    def _pass(self) -> int:
        """Hash every block of the cell once; the bytes hashed."""
        if self.function == "digest":
            of = self._digests.of
            for call, keys in zip(self.calls, self.keys, strict=True):
                of(call, keys)
        else:
            xxh3, rows = xxhash.xxh3_64_intdigest, self._rows
            for call in self.calls:
                for i in call:
                    xxh3(rows[i], 7)
        return sum(len(c) for c in self.calls) * self.block_len

    def measure(self, min_time: float) -> None:
        """One round: one pass (``dram``) or whole passes for ``min_time`` (else)."""
        moved = 0
        with _busy_thread() if self.place == "busy" else contextlib.nullcontext():
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            while True:
                moved += self._pass()
                if self.place == "dram" or time.perf_counter() - wall0 >= min_time:
                    break
            wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        self.cpu_gbps.append(moved / max(cpu, 1e-9) / 1e9)
        self.wall_gbps.append(moved / wall / 1e9)

    def reset(self) -> None:
        self.cpu_gbps.clear()
        self.wall_gbps.clear()


@contextlib.contextmanager
def _busy_thread() -> Iterator[None]:
    """A Python thread that spins (holding the GIL whenever it runs) while the block runs."""
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), name="busy", daemon=True)
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join(timeout=5.0)


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def _spread(values: list[float]) -> dict[str, float]:
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3),
            "min": min(values), "max": max(values)}  # fmt: skip


def measure(
    block_sizes: list[int], arena_mib: int, rounds: int, min_time: float
) -> list[dict[str, Any]]:
    """Every cell's rows: ``block_len``, ``place``, ``function``, ``blocks``, ``gbps_per_core``
    and ``gbps_wall`` (median, IQR, min..max over ``rounds``) and the per-round figures."""
    arena = torch.empty(arena_mib << 20, dtype=torch.uint8)
    arena.fill_(0xA5)  # touch every page; xxh3's speed does not depend on the bytes
    cells = [
        _Cell(arena, bl, place, fn) for bl in block_sizes for place in PLACES for fn in FUNCTIONS
    ]
    interleave(cells, rounds, min_time)
    return [
        {
            "block_len": c.block_len,
            "place": c.place,
            "function": c.function,
            "blocks": sum(len(k) for k in c.calls),
            "gbps_per_core": _spread(c.cpu_gbps),
            "gbps_wall": _spread(c.wall_gbps),
            "gbps_per_core_rounds": [round(x, 3) for x in c.cpu_gbps],
            "gbps_wall_rounds": [round(x, 3) for x in c.wall_gbps],
        }
        for c in cells
    ]


class Timed(Protocol):
    def measure(self, min_time: float) -> None: ...
    def reset(self) -> None: ...


def interleave(cells: Sequence[Timed], rounds: int, min_time: float) -> None:
    """A short warm-up of every cell (code paths, page tables, allocators; then ``reset``),
    then ``rounds`` rounds over the cells in alternating order."""
    for cell in cells:
        cell.measure(min_time / 10)
        cell.reset()
    for r in range(rounds):
        for cell in cells if r % 2 == 0 else cells[::-1]:
            cell.measure(min_time)


def _label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (block size, place): GB/s per core of ``digest`` and ``xxh3``."""

    def cell(row: dict[str, Any], field: str) -> str:
        s = row[field]
        return f"{s['median']:.1f} ({s['q1']:.1f}-{s['q3']:.1f}; {s['min']:.1f}..{s['max']:.1f})"

    by = {(r["block_len"], r["place"], r["function"]): r for r in rows}
    lines = [
        "| block | place | blocks | digest GB/s per core (IQR; min..max) | xxh3 GB/s per core "
        "| digest GB/s wall | xxh3 GB/s wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for bl in dict.fromkeys(r["block_len"] for r in rows):
        for place in PLACES:
            d, x = by[(bl, place, "digest")], by[(bl, place, "xxh3")]
            lines.append(
                f"| {_label(bl)} | {place} | {d['blocks']} | {cell(d, 'gbps_per_core')} "
                f"| {cell(x, 'gbps_per_core')} | {cell(d, 'gbps_wall')} | {cell(x, 'gbps_wall')} |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``--json``; return the exit status."""
    cfg = {k: (v if (v := getattr(args, k, None)) is not None else DEFAULTS[k]) for k in DEFAULTS}
    sizes, arena_mib, rounds, min_time = (cfg[k] for k in DEFAULTS)
    if min_time <= 0 or arena_mib << 20 < max(sizes) * BATCH:
        print("torch-kv-tier digest-cost: --min-time must be > 0 and the arena hold 16 blocks "
              "of the largest size", file=sys.stderr)  # fmt: skip
        return 2
    device = args.device
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        print(f"torch-kv-tier digest-cost: --device {device}: use cpu, or cuda[:n] on a machine "
              "with CUDA", file=sys.stderr)  # fmt: skip
        return 2
    env: dict[str, Any] = {
        "host": platform.node(),
        "cpus": usable_cpus(),
        "xxhash": xxhash.VERSION,
        "loadavg_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["torch-kv-tier", *sys.argv[1:]]),
    }
    if device == "cpu":
        rows = measure(sorted(set(sizes)), arena_mib, rounds, min_time)
        text = table(rows)
    else:
        from torch_kv_tier.benchmarks import digest_gpu  # it uses this module's helpers

        rows = digest_gpu.measure(sorted(set(sizes)), arena_mib, rounds, min_time, device)
        text = digest_gpu.table(rows)
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    env["loadavg_end"] = os.getloadavg()
    print(text)
    print(
        f"\n{rounds} rounds; {device} arena {arena_mib} MiB; load average "
        f"{'/'.join(f'{x:.2f}' for x in env['loadavg_start'])} at start, "
        f"{'/'.join(f'{x:.2f}' for x in env['loadavg_end'])} at end, on {env['cpus']} CPUs"
    )
    if args.json:
        config = {"block_sizes": sizes, "arena_mib": arena_mib, "rounds": rounds,
                  "min_time": min_time, "batch": BATCH, "hot_bytes": HOT_BYTES,
                  "device": device}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"env": env, "config": config, "rows": rows}, f, indent=1)
        print(f"results: {args.json}")
    return 0
