"""What one ``store``/``load`` call costs on top of a bare NIXL loop, and what placement costs.

``python -m torch_kv_tier.benchmarks.call_cost`` starts one loopback ``torch-kv-tier serve``,
then alternates, round after round (tier first in even rounds, bare NIXL first in odd ones), a
burst of synchronous tier calls (``store(...).result()`` of fresh keys, or
``load(...).result()`` of stored ones) with the same burst of bare NIXL calls
(``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state`` until DONE) over as many remote
blocks (one fresh run per call, as the tier walks its lease), Python lists for both.
It prints, per op, the median over rounds of µs per call for each and the median of each
round's difference (tier - raw, the round's two bursts paired), per call and per key: the
tier's own cost, and the speed ratio tier/raw (raw time / tier time) of each
round as median [min-max], the figure the bench's targets are about. It also times key
placement (the home peer of 4,096 keys) at 1, 2, 4 and 16 peers. Single-threaded driver; the
tier's poller runs as in service. Use it to find where per-call time goes (``--profile``
prints a cProfile of the tier's bursts).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from typing import Any

from torch_kv_tier.benchmarks.options import size
from torch_kv_tier.benchmarks.remote import Target, remote_hosts
from torch_kv_tier.benchmarks.system_nixl_raw import BareNixl, local_arena
from torch_kv_tier.cli_numbers import integer


def _tier_burst(tier: Any, op: str, keys: list[list[Any]], local: list[int]) -> float:
    t0 = time.perf_counter()
    call = tier.store if op == "write" else tier.load
    for ks in keys:
        result = call(ks, local).result(timeout=30)
        if not result.ok:
            raise RuntimeError(f"tier {op} failed: {result.failed}")
    return time.perf_counter() - t0


def _raw_burst(raw: BareNixl, op: str, local: list[int], remotes: list[list[int]]) -> float:
    """The same calls as the tier's burst: Python lists, a different remote run per call."""
    t0 = time.perf_counter()
    for remote in remotes:
        handle = raw.post(op, local, remote)  # type: ignore[arg-type]
        while not raw.done(handle):
            pass
    return time.perf_counter() - t0


def placement_us_per_key(peers: int, n: int = 4096) -> float:
    """µs to find the home peer of one key among ``peers`` peers (median of 5 passes)."""
    from torch_kv_tier import keys as keys_mod

    names = [f"127.0.0.1:{5000 + i}/host/{i}" for i in range(peers)]
    ks = [f"block-{i}".encode() * 2 for i in range(n)]
    placement = getattr(keys_mod, "Placement", None)
    times = []
    for _ in range(5):
        if placement is not None:
            p = placement(names)
            t0 = time.perf_counter()
            p.homes(ks)
        else:
            t0 = time.perf_counter()
            for k in ks:
                keys_mod.home_peer(k, names)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kv_tier.benchmarks.call_cost")
    parser.add_argument("--block-len", type=size, default=16 << 10)
    parser.add_argument("--batch", type=integer, default=16)
    parser.add_argument("--calls", type=integer, default=200, help="calls per burst")
    parser.add_argument("--rounds", type=integer, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile the tier's bursts")
    args = parser.parse_args(argv)
    from torch_kv_tier.manager import TierManager

    batch, bl = args.batch, args.block_len
    pool = args.calls * batch * 2
    results: dict[str, dict[str, list[float]]] = {}
    profiler = cProfile.Profile() if args.profile else None
    with remote_hosts(None, {bl: pool}) as hosts:
        target = Target(hosts[bl].address, None, "cpu", bl, 4 * batch, pool // 2, True)
        address = target.require_address()
        tier = TierManager.create(4 * batch, bl, name="call-cost")
        raw = BareNixl("call-cost-raw", local_arena(target, pinned=False), target)
        try:
            tier.connect(address, private=True, slots=pool // 2)
            local = list(range(batch))
            base = raw.remote_base
            remotes = [
                list(range(base + i * batch, base + (i + 1) * batch)) for i in range(args.calls)
            ]
            serial = 0
            for op in ("write", "read"):
                rows = results.setdefault(op, {"tier": [], "raw": []})
                stored = [[f"r{i}-{j}" for j in range(batch)] for i in range(args.calls)]
                if op == "read":
                    _tier_burst(tier, "write", stored, local)
                for rnd in range(args.rounds + 1):
                    if op == "write":
                        serial += 1
                        keys = [
                            [f"w{serial}-{i}-{j}" for j in range(batch)] for i in range(args.calls)
                        ]
                    else:
                        keys = stored
                    for name in ("tier", "raw") if rnd % 2 == 0 else ("raw", "tier"):
                        if name == "raw":
                            seconds = _raw_burst(raw, op, local, remotes)
                        else:
                            if profiler is not None and rnd:
                                profiler.enable()
                            seconds = _tier_burst(tier, op, keys, local)
                            if profiler is not None:
                                profiler.disable()
                        if rnd:  # round 0 warms both up
                            rows[name].append(seconds / args.calls * 1e6)
        finally:
            tier.close()
            raw.close()
    print(f"{bl >> 10} KiB x {batch} blocks per call, {args.calls} calls x {args.rounds} rounds")
    print(
        f"{'op':6} {'tier us/call':>13} {'raw us/call':>12} {'added/call':>11} {'added/key':>10}"
        f"  {'tier/raw median [min-max]':>26}"
    )
    for op, rows in results.items():
        t, r = statistics.median(rows["tier"]), statistics.median(rows["raw"])
        pairs = list(zip(rows["tier"], rows["raw"], strict=True))  # the two bursts of a round
        added = statistics.median(tier - raw for tier, raw in pairs)
        ratios = [raw / tier for tier, raw in pairs]
        spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        print(f"{op:6} {t:13.1f} {r:12.1f} {added:11.1f} {added / batch:10.2f}  {spread:>26}")
    print(
        "placement us/key: "
        + ", ".join(f"{p} peers {placement_us_per_key(p):.2f}" for p in (1, 2, 4, 16))
    )
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
