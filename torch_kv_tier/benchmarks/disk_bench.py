"""``torch-kv-tier disk-bench``: the disk tier behind a host's DRAM (``serve --disk``), measured.

1. **Throughput**: ``DiskStore.write`` and ``read`` (the host's path: DRAM pool slots to and from
   the block file through NIXL's POSIX backend, in requests of ``disk_tier.SPILL_BATCH`` blocks,
   at most ``MAX_SPILLS_IN_FLIGHT`` in flight) against a raw sequential loop of ``os.pwritev`` /
   ``os.preadv`` of one block per call on an O_DIRECT file in the same directory, over the same
   bytes, and the same loop with 8 MiB per call (the ratio is taken to the better of the two
   in each round). A first round of every side warms them up (NIXL's POSIX backend, the files'
   first writes) and is not recorded; the timed rounds alternate the order; each figure is the
   median over rounds, with the median and min..max of the per-round ratio ours / raw. Both
   sides use O_DIRECT when the file system allows it (else both are buffered, and reads may
   come from the page cache: the output says which).
2. **Capacity** (``disk_capacity.capacity``): hit rate over a working set 10x the DRAM pool,
   a host without a disk against one with ``--disk``.
3. **Restart** (``disk_capacity.restart``): time to ``ready`` on the filled disk, and keys kept
   through a SIGKILL in the middle of a store burst.

Exit status 0; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.disk_capacity import capacity, restart
from torch_kv_tier.benchmarks.options import output_file, positive, size, usable_cpus
from torch_kv_tier.remote.disk_store import DiskStore
from torch_kv_tier.remote.disk_tier import MAX_SPILLS_IN_FLIGHT, SPILL_BATCH

PAGE = 4096
LARGE_CALL = 8 << 20  # the second raw baseline's bytes per call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``disk-bench`` options to ``parser``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--dir", type=Path, help="where the files go (default: a new directory under .)"
    )
    parser.add_argument(
        "--block-len", type=size, default=256 << 10, help="bytes per block (default 256K)"
    )
    parser.add_argument(
        "--total-bytes", type=size, default=256 << 20, help="bytes on disk (default 256M)"
    )
    parser.add_argument("--rounds", type=positive, default=5, help="throughput rounds (default 5)")
    parser.add_argument(
        "--pool-mib",
        type=positive,
        default=64,
        help="capacity: DRAM pool, MiB (default %(default)s)",
    )
    parser.add_argument(
        "--disk-mib", type=positive, default=1024, help="capacity: disk, MiB (default %(default)s)"
    )
    parser.add_argument(
        "--capacity-block-len",
        type=size,
        default=64 << 10,
        help="capacity: bytes per block (default 64K)",
    )
    parser.add_argument(
        "--requests", type=positive, default=2000, help="capacity requests (default %(default)s)"
    )
    parser.add_argument(
        "--capacity-rounds", type=positive, default=2, help="capacity rounds (default 2)"
    )
    parser.add_argument(
        "--skip-capacity", action="store_true", help="throughput only (skip parts 2 and 3)"
    )
    parser.add_argument(
        "--json", type=output_file, help="write every figure to this JSON file (default: none)"
    )


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + nbytes]


def _ours(store: DiskStore, kind: str, blocks: int, rnd: int) -> float:
    """Seconds to write (or read back) every pool block through ``store``."""
    started = time.perf_counter()
    for first in range(0, blocks, SPILL_BATCH):
        while store.in_flight() >= MAX_SPILLS_IN_FLIGHT:
            store.poll()
        batch = range(first, min(first + SPILL_BATCH, blocks))
        if kind == "write":
            store.write([("bench", rnd << 32 | i, 0, i) for i in batch])
        else:
            store.read([("bench", rnd << 32 | i, i) for i in batch])
    while store.in_flight():
        store.poll()
    return time.perf_counter() - started


def _raw(fd: int, pool: np.ndarray, kind: str, chunk: int) -> float:
    """Seconds to write (or read) the whole pool sequentially, ``chunk`` bytes per call."""
    started = time.perf_counter()
    move = os.pwritev if kind == "write" else os.preadv
    for offset in range(0, pool.nbytes, chunk):
        view = memoryview(pool[offset : offset + chunk])  # type: ignore[arg-type]
        if move(fd, [view], offset) != len(view):
            raise OSError(f"short {kind} at byte {offset}")
    return time.perf_counter() - started


def throughput(directory: Path, block_len: int, total: int, rounds: int) -> dict[str, Any]:
    blocks = total // block_len
    pool = _aligned(blocks * block_len)
    pool[:] = np.random.default_rng(0).integers(0, 256, pool.shape, dtype=np.uint8)
    store = DiskStore(
        [str(directory / "tier")],
        blocks * block_len,
        block_len=block_len,
        pool_addr=pool.ctypes.data,
        pool_blocks=blocks,
    )
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(directory / "raw.dat", flags, 0o600)
        raw_direct = True
    except OSError:
        fd = os.open(directory / "raw.dat", os.O_RDWR | os.O_CREAT, 0o600)
        raw_direct = False
    os.posix_fallocate(fd, 0, blocks * block_len)
    sides = ("ours", "raw", "raw_large")
    cells: dict[str, list[float]] = {f"{s}_{k}": [] for s in sides for k in ("w", "r")}
    try:
        store.recover()
        for rnd in range(-1, rounds):  # round -1 warms every path up and is not recorded
            order = sides if rnd % 2 == 0 else sides[::-1]
            for kind in ("write", "read"):
                for side in order:
                    if side == "ours":
                        seconds = _ours(store, kind, blocks, rnd + 1)
                    else:
                        chunk = block_len if side == "raw" else max(block_len, LARGE_CALL)
                        seconds = _raw(fd, pool, kind, chunk)
                    if rnd >= 0:
                        cells[f"{side}_{kind[0]}"].append(blocks * block_len / seconds / 1e9)
        stats = store.stats()
    finally:
        os.close(fd)
        store.close()
    out: dict[str, Any] = {
        "block_len": block_len,
        "bytes": blocks * block_len,
        "rounds": rounds,
        "direct_io": {"ours": stats["disk_direct_io"], "raw": raw_direct},
        "failures": stats["disk_failures"],
    }
    for kind in ("w", "r"):
        ours, small, large = (cells[f"{side}_{kind}"] for side in sides)
        raw = [max(a, b) for a, b in zip(small, large)]  # the better baseline of each round
        ratios = [o / r for o, r in zip(ours, raw)]
        name = "write" if kind == "w" else "read"
        out[name] = {
            "ours_gbps": statistics.median(ours),
            "raw_gbps": statistics.median(raw),
            "raw_block_calls_gbps": statistics.median(small),
            "raw_large_calls_gbps": statistics.median(large),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ours_rounds": ours,
            "raw_rounds": raw,
        }
    return out


def _filesystem(path: Path) -> str:
    best = ("", "?")
    with open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            mount, kind = parts[1], parts[2]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, kind)
    return f"{best[1]} ({best[0]})"


def render(report: dict[str, Any]) -> str:
    t = report["throughput"]
    lines = [
        f"# torch-kv-tier disk-bench, {report['date']}; {report['machine']}",
        f"# file system: {report['filesystem']}; O_DIRECT: ours {t['direct_io']['ours']}, "
        f"raw {t['direct_io']['raw']}; {t['bytes'] >> 20} MiB in blocks of "
        f"{t['block_len'] >> 10} KiB, {t['rounds']} rounds alternated",
        "",
        "| op | tier path GB/s | raw, a block per call | raw, 8 MiB per call | tier / the "
        "better raw (min..max) | target |",
        "|---|---|---|---|---|---|",
    ]
    for op in ("write", "read"):
        c = t[op]
        verdict = "met" if c["ratio"] >= 0.8 else "missed"
        lines.append(
            f"| {op} | {c['ours_gbps']:.2f} | {c['raw_block_calls_gbps']:.2f} | "
            f"{c['raw_large_calls_gbps']:.2f} | {c['ratio']:.2f} "
            f"({c['ratio_min']:.2f}..{c['ratio_max']:.2f}) | >= 0.8: {verdict} |"
        )
    cap = report.get("capacity")
    if cap:
        lines += [
            "",
            f"capacity: {cap['pool_mib']} MiB DRAM pool, {cap['disk_mib']} MiB disk, working set "
            f"{cap['working_set_mib']} MiB ({cap['prefixes']} prefixes of {cap['prefix_blocks']} "
            f"blocks of {cap['block_len'] >> 10} KiB), {cap['requests']} uniform requests after "
            "a warm-up of two passes",
            "",
            "| round | host | hit rate | prefixes loaded whole | promotions | wrong blocks | s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in cap["rounds"]:
            lines.append(
                f"| {r['round']} | {'DRAM + disk' if r['kind'] == 'disk' else 'DRAM only'} | "
                f"{r['hit_rate']:.3f} | {r['hits']} | {r['disk_promotions']} | {r['wrong']} | "
                f"{r['seconds']:.1f} |"
            )
    rs = report.get("restart")
    if rs:
        lines += [
            "",
            f"restart on the filled disk: ready in {rs['ready_s']:.2f} s with "
            f"{rs['keys_on_disk']} keys ({rs['ready_without_disk_s']:.2f} s without a disk; "
            f"medians of {len(rs['ready_rounds'])} alternated rounds): the median paired "
            f"difference is {rs['recovery_s_per_million_keys']:.1f} s per million keys of "
            f"{report['capacity']['block_len'] >> 10} KiB; after a SIGKILL mid-burst: "
            f"{rs['keys_after_kill_restart']} keys recovered ({rs['keys_before_kill']} on disk "
            f"just before the kill), {rs['dropped_at_recovery']} dropped by verification",
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.total_bytes < args.block_len or args.block_len % PAGE:
        print("torch-kv-tier disk-bench: --block-len must be a multiple of 4096 and at most "
              "--total-bytes", file=sys.stderr)  # fmt: skip
        return 2
    made = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="tkvt-disk-bench-", dir=".")) if made else args.dir
    directory.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{usable_cpus()} CPUs, {platform.machine()}, "
        f"load {os.getloadavg()[0]:.2f} at start",
        "filesystem": _filesystem(directory),
    }
    try:
        report["throughput"] = throughput(directory, args.block_len, args.total_bytes, args.rounds)
        if not args.skip_capacity:
            cap = capacity(
                pool_mib=args.pool_mib,
                disk_mib=args.disk_mib,
                block_len=args.capacity_block_len,
                rounds=args.capacity_rounds,
                requests=args.requests,
                seed=0,
            )
            report["capacity"] = cap
            try:
                report["restart"] = restart(
                    Path(cap["disk_dir"]),
                    pool_mib=args.pool_mib,
                    disk_mib=args.disk_mib,
                    block_len=args.capacity_block_len,
                )
            finally:
                shutil.rmtree(cap["workdir"], ignore_errors=True)
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    report["machine"] += f", load {os.getloadavg()[0]:.2f} at end"
    print(render(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
