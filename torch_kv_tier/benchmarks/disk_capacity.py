"""What a disk tier behind a host's DRAM buys, end to end (``torch-kv-tier disk-bench``'s
capacity and restart figures): real ``serve`` processes and a real tier.

``capacity``: one tier plays an engine over a working set of prefixes ``WORKING_SET_X`` times
the host's DRAM pool. Each request picks a prefix (uniformly, seeded) and loads it; a prefix
that does not load whole is stored again, as an engine that recomputed it would. After two
warm-up passes over every prefix, the hit rate (prefixes loaded whole / requests) and the disk
promotions are measured over the same request sequence against a host without a disk and a
host with ``--disk``, in alternating rounds (a fresh host each), every loaded block checked
against the bytes stored.

``restart``: the host with the disk filled by ``capacity`` is stopped (SIGTERM) and started on
the same directory: seconds to ``ready`` (recovery reads and verifies every block) against the
start of a host without a disk, in ``RESTART_ROUNDS`` rounds that alternate which starts first;
the median of each round's difference, per million keys. Then a store burst is cut by SIGKILL
and the host restarted: keys recovered, of those whose copy had completed.

Threading: single-threaded driver; the tier's own threads do the I/O.
"""

from __future__ import annotations

import logging
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from torch_kv_tier.benchmarks.reliability_common import server_stats
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

logger = logging.getLogger(__name__)

WORKING_SET_X = 10  # the working set, in multiples of the DRAM pool
PREFIX_BLOCKS = 16  # blocks per request
RESULT_TIMEOUT_S = 60.0
RESTART_ROUNDS = 3  # starts with and without the disk, the order alternated


def _serve(
    pool_blocks: int, block_len: int, disk: Path | None, disk_bytes: int, admit: int = 2
) -> ServerProcess:
    args: list[str] = []
    if disk is not None:
        args += ["--disk", str(disk), "--disk-bytes", str(disk_bytes)]
        args += ["--disk-admit", str(admit)]
    return ServerProcess.start(pool_blocks, block_len, extra_args=args, timeout_s=600)


def _serve_requests(
    tier: TierManager, prefixes: int, requests: list[int], original: torch.Tensor
) -> dict[str, int]:
    """Play ``requests`` (prefix numbers); returns hits, misses and wrong blocks."""
    counts = dict.fromkeys(("hits", "misses", "wrong", "blocks_loaded"), 0)
    local = list(range(PREFIX_BLOCKS))
    for prefix in requests:
        keys = [f"p{prefix}-b{b}".encode() for b in range(PREFIX_BLOCKS)]
        loaded = tier.load(keys, local).result(timeout=RESULT_TIMEOUT_S)
        ok = [i for i, k in enumerate(keys) if k not in loaded.failed]
        counts["blocks_loaded"] += len(ok)
        if ok:
            want = original[prefix * PREFIX_BLOCKS + torch.tensor(ok)]
            got = tier.arena.tensor[ok]
            counts["wrong"] += int((got != want).any(dim=1).sum())
        if loaded.ok:
            counts["hits"] += 1
            continue
        counts["misses"] += 1
        source = range(PREFIX_BLOCKS + prefix * PREFIX_BLOCKS, PREFIX_BLOCKS * (prefix + 2))
        stored = tier.store(keys, list(source)).result(timeout=RESULT_TIMEOUT_S)
        if not stored.ok:
            logger.warning("store of prefix %d: %s", prefix, set(stored.failed.values()))
    return counts


def capacity(
    *, pool_mib: int, disk_mib: int, block_len: int, rounds: int, requests: int, seed: int
) -> dict[str, Any]:
    """The hit rate over a working set ``WORKING_SET_X`` times the pool, without and with a
    disk of ``disk_mib`` behind it (module docstring). Leaves the last disk directory for
    ``restart`` (its path in the result)."""
    pool_blocks = (pool_mib << 20) // block_len
    prefixes = pool_blocks * WORKING_SET_X // PREFIX_BLOCKS
    rng = random.Random(seed)
    sequence = [rng.randrange(prefixes) for _ in range(requests)]
    warmup = list(range(prefixes))
    arena_blocks = PREFIX_BLOCKS * (prefixes + 1)
    workdir = Path(tempfile.mkdtemp(prefix="tkvt-disk-bench-", dir="."))
    rows: list[dict[str, Any]] = []
    with TierManager.create(arena_blocks, block_len, name="engine") as tier:
        data = torch.randint(0, 256, (prefixes * PREFIX_BLOCKS, block_len), dtype=torch.uint8)
        tier.arena.tensor[PREFIX_BLOCKS:] = data
        for rnd in range(rounds):
            for kind in ("dram", "disk") if rnd % 2 == 0 else ("disk", "dram"):
                disk = workdir / f"disk-{rnd}" if kind == "disk" else None
                with _serve(pool_blocks, block_len, disk, disk_mib << 20) as server:
                    tier.connect(server.address)
                    _serve_requests(tier, prefixes, warmup + warmup, data)
                    warm = server_stats(server.address, block_len)
                    started = time.perf_counter()
                    counts = _serve_requests(tier, prefixes, sequence, data)
                    seconds = time.perf_counter() - started
                    stats = server_stats(server.address, block_len)
                    tier.remove_peer(tier.peers()[0])
                rows.append(
                    {
                        "round": rnd,
                        "kind": kind,
                        **counts,
                        "hit_rate": counts["hits"] / len(sequence),
                        "seconds": seconds,
                        # the timed requests' own, not the warm-up's
                        "disk_promotions": stats.get("disk_promotions", 0)
                        - warm.get("disk_promotions", 0),
                        "disk_keys": stats.get("disk_keys", 0),
                    }
                )
                if disk is not None and rnd < rounds - 1:
                    shutil.rmtree(disk)
    last_disk = next(workdir / f"disk-{r['round']}" for r in reversed(rows) if r["kind"] == "disk")
    return {
        "pool_mib": pool_mib,
        "disk_mib": disk_mib,
        "block_len": block_len,
        "prefixes": prefixes,
        "prefix_blocks": PREFIX_BLOCKS,
        "working_set_mib": prefixes * PREFIX_BLOCKS * block_len >> 20,
        "requests": len(sequence),
        "rounds": rows,
        "workdir": str(workdir),
        "disk_dir": str(last_disk),
    }


def restart(disk_dir: Path, *, pool_mib: int, disk_mib: int, block_len: int) -> dict[str, Any]:
    """Time to ``ready`` on a filled disk vs without a disk (medians over ``RESTART_ROUNDS``
    alternated rounds; the recovery cost from each round's paired difference), and keys kept
    through a SIGKILL in the middle of a store burst (module docstring)."""
    pool_blocks = (pool_mib << 20) // block_len
    seconds: dict[bool, list[float]] = {False: [], True: []}  # with the disk: seconds to ready
    keys_found = 0
    for rnd in range(RESTART_ROUNDS):
        for with_disk in (False, True) if rnd % 2 == 0 else (True, False):
            started = time.perf_counter()
            disk = disk_dir if with_disk else None
            with _serve(pool_blocks, block_len, disk, disk_mib << 20 if with_disk else 0) as server:
                seconds[with_disk].append(time.perf_counter() - started)
                if with_disk:
                    keys_found = server_stats(server.address, block_len)["disk_keys"]
    recovery = statistics.median(d - b for d, b in zip(seconds[True], seconds[False], strict=True))
    with _serve(pool_blocks, block_len, disk_dir, disk_mib << 20, admit=1) as server:
        burst_keys = [f"burst-{i}".encode() for i in range(2 * pool_blocks)]
        with TierManager.create(len(burst_keys), block_len, name="burst") as tier:
            tier.connect(server.address)
            tier.arena.tensor.random_(0, 256)
            for i in range(0, len(burst_keys), 256):
                tier.store(burst_keys[i : i + 256], range(i, min(i + 256, len(burst_keys))))
                time.sleep(0.005)
            before = server_stats(server.address, block_len)["disk_keys"]
            server.kill()
    with _serve(pool_blocks, block_len, disk_dir, disk_mib << 20) as server:
        after = server_stats(server.address, block_len)
    return {
        "keys_on_disk": keys_found,
        "ready_s": statistics.median(seconds[True]),
        "ready_without_disk_s": statistics.median(seconds[False]),
        "ready_rounds": [list(pair) for pair in zip(seconds[True], seconds[False], strict=True)],
        "recovery_s_per_million_keys": max(recovery, 0.0) / max(keys_found, 1) * 1e6,
        "keys_before_kill": before,
        "keys_after_kill_restart": after["disk_keys"],
        "dropped_at_recovery": after.get("disk_recover_dropped", 0),
    }
