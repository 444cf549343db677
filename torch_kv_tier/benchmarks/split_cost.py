"""What posting every transfer whole costs, against NIXL splitting it across worker threads.

With ``num_threads`` workers NIXL's UCX backend splits a transfer of 1,024 descriptors or more
across them, and one part's failure completes the others while they still run. The tier's
transport has no worker threads by default, and creates the backend with ``split_batch_size``
above any transfer when given some (``ucx_env.ucx_backend_params``). This measures what that
costs. A target process lends a ``NixlTransport`` with defaults; this process builds two
initiators as tier clients (``passive_progress=False``): the tier's default (whole) and one as
vLLM's transport configures NIXL, 4 worker threads with NIXL's default split (split). It times
``--xfers`` transfers in flight of 1,024 or more blocks each, write then read, at two block
lengths. Which initiator goes first swaps every round; the ratio whole/split is taken per round
and reported as its median and min-max. Each initiator then writes its own pattern, reads it
back into a zeroed arena and checks every byte. The threads and file descriptors each one adds,
connected, are counted after a first agent started what a process starts once.

Run: ``python -m torch_kv_tier.benchmarks.split_cost [--rounds 30] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from torch_kv_tier.benchmarks.options import output_file
from torch_kv_tier.benchmarks.reliability_common import environment
from torch_kv_tier.cli_numbers import integer

# (block length, blocks per transfer): 1,024 or more, so NIXL's default would split them.
POINTS = ((16384, 2048), (262144, 1024))
SPLIT_THREADS = 4  # the reference's worker threads: vLLM's transport's default
OPS = ("WRITE", "READ")


def _target(conn: Connection, env: dict[str, str], num_blocks: int, block_len: int) -> None:
    os.environ.update(env)
    from torch_kv_tier.transport import NixlTransport

    transport = NixlTransport("split-target", torch.zeros(num_blocks, block_len, dtype=torch.uint8))
    conn.send((transport.get_agent_metadata(), transport.base_addr))
    conn.recv()  # None: done
    transport.close()


@contextlib.contextmanager
def _nixl_default_split() -> Iterator[None]:
    """While active, new agents get NIXL's default ``split_batch_size`` (the reference)."""
    from torch_kv_tier.transport import nixl_agent

    ours = nixl_agent.ucx_backend_params

    def default_split(*args: Any, **kwargs: Any) -> dict[str, str]:
        params = ours(*args, **kwargs)
        params.pop("split_batch_size", None)
        return params

    nixl_agent.ucx_backend_params = default_split
    try:
        yield
    finally:
        nixl_agent.ucx_backend_params = ours


def _initiator(
    name: str, whole: bool, num_blocks: int, block_len: int, peer: tuple, arena_blocks: int
) -> Any:
    """A tier-client transport of ``arena_blocks`` random blocks, the target added as a peer."""
    from torch_kv_tier.transport import NixlTransport

    arena = torch.randint(0, 256, (arena_blocks, block_len), dtype=torch.uint8)
    if whole:
        t = NixlTransport(name, arena, passive_progress=False)
    else:
        with _nixl_default_split():
            t = NixlTransport(name, arena, num_threads=SPLIT_THREADS, passive_progress=False)
    t.add_remote_peer("target", peer[0], peer[1], num_blocks, block_len)
    return t


def _run(t: Any, op: str, num_blocks: int, xfers: int, timeout_s: float = 120.0) -> float:
    """Seconds for ``xfers`` transfers of every block, all in flight at once."""
    blocks = list(range(num_blocks))
    post = t.write_blocks if op == "WRITE" else t.read_blocks
    start = time.perf_counter()
    pending = {post("target", blocks, blocks) for _ in range(xfers)}
    if None in pending:
        raise RuntimeError(f"{op}: NIXL refused to post a transfer")
    while pending:
        result = t.poll()
        if result.failed:
            raise RuntimeError(f"{op}: transfers {sorted(result.failed)} failed")
        pending -= set(result.done)
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{op}: {len(pending)} transfers not done within {timeout_s} s")
    return time.perf_counter() - start


def _threads_and_fds() -> dict[str, int]:
    """This process's threads and open file descriptors (sockets included)."""
    return {
        "threads": len(os.listdir(f"/proc/{os.getpid()}/task")),
        "fds": len(os.listdir(f"/proc/{os.getpid()}/fd")),
    }


def _verifies(t: Any, num_blocks: int) -> bool:
    """Write this arena, read it back into a zeroed one: every byte the same."""
    sent = t.region.owner.clone()
    _run(t, "WRITE", num_blocks, 1)
    t.region.owner.zero_()
    _run(t, "READ", num_blocks, 1)
    return bool(torch.equal(t.region.owner, sent))


def measure(tls: str | None, block_len: int, num_blocks: int, rounds: int, xfers: int) -> dict:
    """One point: both initiators against one target, interleaved (module docstring)."""
    env = {"UCX_TLS": tls} if tls else {}
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, env, num_blocks, block_len), daemon=True)
    with environment(env):  # UCX reads it as agents are created
        proc.start()
        systems: dict[str, Any] = {}
        try:
            if not conn.poll(60):
                raise TimeoutError("target did not start within 60 s")
            peer = conn.recv()
            warm = _initiator("warm", True, num_blocks, block_len, peer, arena_blocks=1)
            _run(warm, "WRITE", 1, 1)  # what the first agent of a process starts, started
            warm.close()
            added: dict[str, dict[str, int]] = {}
            for name in ("whole", "split"):
                before = _threads_and_fds()
                systems[name] = _initiator(
                    name, name == "whole", num_blocks, block_len, peer, num_blocks
                )
                _run(systems[name], "WRITE", 1, 1)  # connected: UCX wires its endpoints up
                added[name] = {k: n - before[k] for k, n in _threads_and_fds().items()}
            gbytes = xfers * num_blocks * block_len / 1e9
            rates: dict[tuple[str, str], list[float]] = {(s, op): [] for s in systems for op in OPS}
            for r in range(rounds + 1):  # round 0 warms up
                for name in ("whole", "split") if r % 2 == 0 else ("split", "whole"):
                    for op in OPS:
                        rate = gbytes / _run(systems[name], op, num_blocks, xfers)
                        if r > 0:
                            rates[(name, op)].append(rate)
            row: dict[str, Any] = {
                "ucx_tls": tls or "default",
                "block_len": block_len,
                "blocks_per_transfer": num_blocks,
                "xfers_in_flight": xfers,
                "rounds": rounds,
                # the live agents' UCX backend options (what each really runs with)
                "ucx_options": {
                    name: dict(t._agent.backend_options["UCX"]) for name, t in systems.items()
                },
                "threads_and_fds_added": added,  # by the initiator, connected to one peer
                "verified": all(_verifies(t, num_blocks) for t in systems.values()),
            }
            for op in OPS:
                ratios = [w / s for w, s in zip(rates[("whole", op)], rates[("split", op)])]
                row[op.lower()] = {
                    "whole_gbps_median": statistics.median(rates[("whole", op)]),
                    "split_gbps_median": statistics.median(rates[("split", op)]),
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            conn.send(None)
            return row
        finally:
            for t in systems.values():
                t.close()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=integer, default=30, help="timed rounds (default 30)")
    parser.add_argument("--xfers", type=integer, default=4, help="transfers in flight (default 4)")
    parser.add_argument("--json", type=output_file, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.xfers < 1:
        parser.error("--rounds and --xfers must be at least 1")
    rows = [
        measure(tls, block_len, num_blocks, args.rounds, args.xfers)
        for tls in (None, "tcp")
        for block_len, num_blocks in POINTS
    ]
    print(
        "| UCX_TLS | block | blocks per transfer | op | whole GB/s | split GB/s | "
        "whole/split median (min-max) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for op in OPS:
            f = r[op.lower()]
            print(
                f"| {r['ucx_tls']} | {r['block_len'] // 1024} KiB | {r['blocks_per_transfer']} | "
                f"{op} | {f['whole_gbps_median']:.2f} | {f['split_gbps_median']:.2f} | "
                f"{f['ratio_median']:.2f} ({f['ratio_min']:.2f}-{f['ratio_max']:.2f}) |"
            )
    for r in rows:
        added = r["threads_and_fds_added"]
        print(
            f"{r['ucx_tls']}, {r['block_len'] // 1024} KiB: threads and file descriptors an "
            f"initiator added, connected to one peer: whole {added['whole']}, split "
            f"{added['split']}"
        )
    verified = all(r["verified"] for r in rows)
    print(f"every byte verified: {verified}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
