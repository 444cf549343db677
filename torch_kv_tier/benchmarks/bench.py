"""``torch-kv-tier bench``: the tier side by side with raw NIXL, memcpy and peer transports.

For every transport (UCX's default, shared memory on loopback, and ``tcp``, where transfers stay
in flight) and block length, the NIXL systems share embedded ``torch-kv-tier serve`` hosts on
loopback (or ``--remote``). The tier is measured interleaved with each reference it is compared
to: both are open, and their timed repeats of a point alternate (A B, B A, ...), so that a
change of load on a shared machine hits both; ratios are reported as the median and the
min-max over the paired repeats. Results go to stdout (tables, ratios, the tier's added cost per
call and per key, targets), ``--out`` (JSON rows) and ``--plot`` (PNG). Exit status: 0 when
every measured point verified, 1 when a point failed or moved wrong bytes, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch_kv_tier.benchmarks import report, report_verify
from torch_kv_tier.benchmarks.core import OPS, PATTERNS, Skip, System
from torch_kv_tier.benchmarks.options import list_of, positive, quiet_nixl, size
from torch_kv_tier.benchmarks.remote import Target, host_group, read_token
from torch_kv_tier.benchmarks.sweep import Point, PointRunner, PointState, Settings

logger = logging.getLogger(__name__)

# name -> "module:class"; imported only when the system runs (vLLM alone takes seconds).
SYSTEMS: dict[str, str] = {
    "memcpy": "torch_kv_tier.benchmarks.system_memcpy:Memcpy",
    "nixl_raw": "torch_kv_tier.benchmarks.system_nixl_raw:NixlRaw",
    "vllm_nixl": "torch_kv_tier.benchmarks.system_vllm_nixl:VllmNixl",
    "mooncake_tcp": "torch_kv_tier.benchmarks.system_mooncake:MooncakeTcp",
    "torch_kv_tier": "torch_kv_tier.benchmarks.system_tier:Tier",
    "torch_kv_tier_noverify": "torch_kv_tier.benchmarks.system_tier:TierNoVerify",
    "torch_kv_tier_2hosts": "torch_kv_tier.benchmarks.system_tier:TierOver2Hosts",
    "torch_kv_tier_4hosts": "torch_kv_tier.benchmarks.system_tier:TierOver4Hosts",
    "torch_kv_tier_staged": "torch_kv_tier.benchmarks.system_tier:StagedTier",
}
GPU_ONLY = {"torch_kv_tier_staged"}
OPT_IN = {"torch_kv_tier_noverify"}  # run only when named in --systems
TIER = report.TIER
TIERS = (TIER, "torch_kv_tier_noverify")  # interleaved with each reference, side by side
PAIRED = ("nixl_raw", "vllm_nixl")  # references the tier is interleaved with
MULTI_HOST = ("torch_kv_tier_2hosts", "torch_kv_tier_4hosts")
NO_TRANSPORT = ("memcpy",)
MAX_GROUP = 3  # systems holding a lease on the first host at once (+1 for vLLM's reader)
MAX_HOSTS = 4

QUICK = {
    "transports": ["shm"],
    "block_sizes": [16 << 10, 64 << 10, 256 << 10],
    "batches": [16],
    "tcp_batches": [16],
    "tcp_max_block": 256 << 10,
    "inflight": [2],
    "repeats": 3,
    "min_time": 0.02,
    "warmup": 0.01,
    "working_set_mib": 8,
    "pool_mib": 16,
    "poll_depths": [10, 100, 1000, 10000],
    "multi_host": False,
    "multi_host_block": 64 << 10,
    "multi_host_batch": 16,
}
FULL = {
    "transports": ["shm", "tcp"],
    "block_sizes": [16 << 10, 64 << 10, 256 << 10, 2 << 20],
    "batches": [16],
    "tcp_batches": [16],
    "tcp_max_block": 256 << 10,
    "inflight": [1, 8],
    "repeats": 7,
    "min_time": 0.1,
    "warmup": 0.03,
    "working_set_mib": 32,
    "pool_mib": 64,
    "poll_depths": [10, 100, 1000, 10000],
    "multi_host": True,
    "multi_host_block": 64 << 10,
    "multi_host_batch": 16,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser``."""
    parser.description = __doc__
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda[:n]: where the source arena lives"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small sweep that finishes in under a minute on 2 cores",
    )
    parser.add_argument(
        "--systems",
        type=list_of(str, list(SYSTEMS)),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )
    parser.add_argument("--block-sizes", type=list_of(size), help="e.g. 16K,64K,256K,2M")
    parser.add_argument("--batches", type=list_of(positive), help="blocks per call, e.g. 1,16,128")
    parser.add_argument("--inflight", type=list_of(positive), help="calls in flight, e.g. 1,8")
    parser.add_argument("--ops", type=list_of(str, OPS), default=list(OPS), help="write,read")
    parser.add_argument(
        "--patterns",
        type=list_of(str, PATTERNS),
        default=list(PATTERNS),
        help="contiguous,scattered",
    )
    parser.add_argument("--repeats", type=positive, help="timed repeats per point (median)")
    parser.add_argument("--min-time", type=float, help="seconds per timed repeat (at least)")
    parser.add_argument(
        "--pool-mib",
        type=positive,
        help="remote pool per block size, MiB (the local arena is twice this)",
    )
    parser.add_argument(
        "--working-set-mib",
        type=positive,
        help="bytes cycled through per point, MiB (bounded by the pool)",
    )
    parser.add_argument(
        "--mean-run",
        type=float,
        default=4.0,
        help="mean run length of the scattered pattern's free list (1 = permuted)",
    )
    parser.add_argument(
        "--poll-depths",
        type=list_of(positive),
        help="transfers in flight for the poll-cost measurement",
    )
    parser.add_argument(
        "--no-poll-scaling", action="store_true", help="skip the poll-cost measurement"
    )
    parser.add_argument(
        "--remote",
        metavar="HOST:PORT",
        help="use this `torch-kv-tier serve` instead of an embedded one",
    )
    parser.add_argument("--token-file", help="file holding the remote host's token")
    parser.add_argument(
        "--transports",
        type=list_of(str, ["shm", "tcp"]),
        help="shm (UCX's default on loopback), tcp, or both (default: shm for --quick, both "
        "for a full run)",
    )
    parser.add_argument(
        "--ucx-tls",
        help="measure one transport: set UCX_TLS to this for the run and the embedded servers",
    )
    parser.add_argument("--out", help="write the result rows to this JSON file")
    parser.add_argument("--plot", help="draw GB/s against block size to this PNG")
    parser.add_argument("--seed", type=int, default=1234, help="seed of plans and byte patterns")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    base = QUICK if args.quick else FULL
    given = {k: getattr(args, k, None) for k in base}
    cfg: dict[str, Any] = {k: (base[k] if v is None else v) for k, v in given.items()}
    cfg["block_sizes"] = sorted(set(cfg["block_sizes"]))
    if args.batches:
        cfg["tcp_batches"] = args.batches
    if args.ucx_tls:
        cfg["transports"] = [args.ucx_tls]  # one pass, under that UCX_TLS
    return cfg


def _device(text: str) -> str:
    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text if ":" in text else "cuda:0"
    raise ValueError(f"--device must be cpu or cuda[:n], got {text!r}")


def _environment(device: str) -> dict[str, Any]:
    import torch

    try:
        from importlib.metadata import version

        nixl_version = version("nixl")
    except Exception:
        nixl_version = None
    gpu = torch.cuda.get_device_name(device) if device != "cpu" else None
    return {
        "host": platform.node(),
        "gpu": gpu,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nixl": nixl_version,
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        "device": device,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _load(name: str) -> Callable[[Target], System]:
    """The constructor of system ``name``; ``Skip`` when its module cannot be imported."""
    module, cls = SYSTEMS[name].split(":")
    try:
        loaded = importlib.import_module(module)
    except ImportError as exc:
        raise Skip(f"cannot import {module}: {exc}") from exc
    factory: Callable[[Target], System] = getattr(loaded, cls)
    return factory


class _Run:
    """One ``bench`` invocation: the sweep loop, its rows and its progress bar.

    For each transport (UCX default, i.e. shared memory on loopback, then ``tcp``) and block
    length, remote hosts are started; then each *group* of systems is opened together and every
    point is measured on all of them, repeat by repeat in alternating order (A B, B A, ...), so
    that a change of load hits every system of the group alike. Groups pair the tier (and
    ``torch_kv_tier_noverify`` when asked for: the tiers of ``TIERS``, side by side) with each
    reference it is compared to (``nixl_raw``, ``vllm_nixl``); the multi-host tiers share a group
    with ``nixl_raw`` at the multi-host points. Other systems run alone.
    """

    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any], device: str) -> None:
        self.args = args
        self.cfg = cfg
        self.device = device
        self.env = _environment(device)
        self.rows: list[report.Row] = []
        default = [n for n in SYSTEMS if n not in OPT_IN and (n not in GPU_ONLY or device != "cpu")]
        if not cfg["multi_host"]:
            default = [n for n in default if n not in MULTI_HOST]
        self.systems: list[str] = args.systems or default
        self.runner = PointRunner(
            Settings(
                repeats=cfg["repeats"],
                min_time=cfg["min_time"],
                warmup=cfg["warmup"],
                working_set=cfg["working_set_mib"] << 20,
                mean_run=args.mean_run,
                seed=args.seed,
            )
        )
        self.plan = [(tls, bl) for tls in cfg["transports"] for bl in self._sizes(tls)]
        self.transport: str = cfg["transports"][0]

    def _sizes(self, transport: str) -> list[int]:
        sizes: list[int] = self.cfg["block_sizes"]
        if transport == "shm":
            return sizes
        return [bl for bl in sizes if bl <= self.cfg["tcp_max_block"]] or sizes[:1]

    def points(self, transport: str) -> list[Point]:
        batches = self.cfg["batches"] if transport == "shm" else self.cfg["tcp_batches"]
        return [
            Point(op, pattern, 0, batch, depth)
            for op in self.args.ops
            for pattern in self.args.patterns
            for batch in batches
            for depth in self.cfg["inflight"]
        ]

    def multi_points(self, block_len: int) -> list[Point]:
        if block_len != self.cfg["multi_host_block"] or not self._multi():
            return []
        batch = self.cfg["multi_host_batch"]
        return [
            Point(op, "contiguous", block_len, batch, depth)
            for op in self.args.ops
            for depth in self.cfg["inflight"]
        ]

    def _multi(self) -> list[str]:
        return [n for n in self.systems if n in MULTI_HOST]

    def groups(self) -> list[list[str]]:
        """Systems measured together (see the class docstring); the multi-host group apart.
        ``memcpy`` uses no transport: it runs in the first transport's pass only."""
        first = self.transport == self.cfg["transports"][0]
        singles = [
            n for n in self.systems if n not in MULTI_HOST and (first or n not in NO_TRANSPORT)
        ]
        tiers = [n for n in singles if n in TIERS]
        groups: list[list[str]] = []
        for name in singles:
            if name in TIERS:
                continue
            groups.append([name, *tiers] if name in PAIRED else [name])
        if tiers and not any(tiers[0] in g for g in groups):
            groups.append(tiers)
        return groups

    def total(self) -> int:
        n = 0
        for tls, bl in self.plan:
            self.transport = tls
            n += sum(len(g) for g in self.groups()) * len(self.points(tls))
            n += (len(self._multi()) + 1) * len(self.multi_points(bl))
        self.transport = self.cfg["transports"][0]
        return n

    def _row(self, system: str, path: str, point: Point, group: str, **fields: Any) -> None:
        row: report.Row = {
            "kind": "throughput",
            "system": system,
            "group": group,
            "transport": self.transport,
            "path": path,
            "op": point.op,
            "device": self.device,
            "pattern": point.pattern,
            "mean_run": self.args.mean_run if point.pattern == "scattered" else None,
            "block_len": point.block_len,
            "batch": point.batch,
            "inflight": point.inflight,
            "inflight_requested": point.inflight,
            "gbps": None,
            "blocks_per_s": None,
            "p50_us": None,
            "p99_us": None,
            "verified": False,
            "skipped": None,
            "error": None,
            "env": self.env,
        }
        row.update(fields)
        self.rows.append(row)

    def sweep(self, progress: Any) -> None:
        token = read_token(self.args.token_file)
        user_tls = os.environ.get("UCX_TLS")
        try:
            for transport in self.cfg["transports"]:
                self.transport = transport
                if transport == "shm":
                    _set_env("UCX_TLS", user_tls)
                else:
                    os.environ["UCX_TLS"] = transport
                self._transport_sweep(transport, token, progress)
        finally:
            _set_env("UCX_TLS", user_tls)

    def _transport_sweep(self, transport: str, token: str | None, progress: Any) -> None:
        polls_wanted = not self.args.no_poll_scaling
        sizes = self._sizes(transport)
        for block_len in sizes:
            pool = max(1, (self.cfg["pool_mib"] << 20) // block_len)
            # Every system leases as many remote slots as the working set has blocks, so that
            # the tier (which walks its whole lease, evicting) touches no more remote memory
            # than the systems whose plans cycle through the working set.
            lease = min(pool, -(-(self.cfg["working_set_mib"] << 20) // block_len))
            slack = max(self.cfg["inflight"]) * max(self.cfg["batches"] + self.cfg["tcp_batches"])
            multi = self.multi_points(block_len)
            # Each system of a group holds its own lease: the first host holds them all.
            # The previous group's leases may still be on their way back: room for two groups.
            pools = [2 * (lease + slack) * (MAX_GROUP + 1)]
            pools += [2 * (lease + slack)] * (MAX_HOSTS - 1 if multi else 0)
            # (a multi-host tier leases 1.5 x lease / hosts on each host: within these pools)
            progress.set_description(f"{transport}: starting hosts for {block_len >> 10}K")
            with host_group(self.args.remote, block_len, pools) as hosts:
                target = Target(
                    address=hosts[0].address,
                    token=token,
                    device=self.device,
                    block_len=block_len,
                    local_slots=2 * pool,
                    remote_slots=lease,
                    embedded=hosts[0].embedded,
                    problem=hosts[0].problem,
                    more_addresses=tuple(h.address for h in hosts[1:] if h.address),
                    slack_slots=slack,
                )
                points = [replace(p, block_len=block_len) for p in self.points(transport)]
                for group in self.groups():
                    self._group(group, target, points, progress)
                if multi:
                    names = (["nixl_raw"] if "nixl_raw" in self.systems else []) + self._multi()
                    self._group(names, target, multi, progress, label="multi-host")
                if polls_wanted:
                    progress.set_description(f"{transport}: poll scaling {block_len >> 10}K")
                    last = block_len == sizes[-1]
                    polls_wanted = not self._poll_scaling(target, last=last)

    def _poll_scaling(self, target: Target, *, last: bool) -> bool:
        """Measure poll scaling at the smallest block size the remote host serves; True once
        rows were recorded (skipped rows only when no block size is served)."""
        from torch_kv_tier.benchmarks.poll_scaling import measure_poll_scaling

        rows = measure_poll_scaling(target, self.cfg["poll_depths"], self.env)
        for row in rows:
            row["transport"] = self.transport
        if all(r["skipped"] for r in rows) and not last:
            return False
        self.rows += rows
        return True

    def _open(self, name: str, target: Target) -> System | str:
        """The system, or the reason it cannot run here (logged)."""
        try:
            return _load(name)(target)
        except Skip as exc:
            logger.info("%s skipped: %s", name, exc)
            return f"skip:{exc}"
        except Exception as exc:
            logger.exception("%s failed to start", name)
            return f"error:start failed: {exc}"

    def _group(
        self,
        names: list[str],
        target: Target,
        points: list[Point],
        progress: Any,
        label: str | None = None,
    ) -> None:
        progress.set_description(f"{self.transport} {target.block_len >> 10}K: {'+'.join(names)}")
        group = label or names[0]
        opened: dict[str, System] = {}
        try:
            for name in names:
                system = self._open(name, target)
                if isinstance(system, str):
                    kind, reason = system.split(":", 1)
                    path = "vram" if self.device != "cpu" else "host"
                    for point in points:
                        fields = {"skipped": reason} if kind == "skip" else {"error": reason}
                        self._row(name, path, point, group, **fields)
                    progress.update(len(points))
                else:
                    opened[name] = system
            for point in points:
                self._interleaved(opened, point, group)
                progress.update(len(opened))
        finally:
            for system in opened.values():
                system.close()

    def _interleaved(self, systems: dict[str, System], point: Point, group: str) -> None:
        """Measure ``point`` on every system, their timed repeats alternating A B, B A, ..."""
        states: dict[str, PointState] = {}
        failed: dict[str, str] = {}
        for name, system in systems.items():
            if point.op not in system.ops:
                self._row(name, system.path, point, group, skipped=f"{name} has no {point.op} path")
                continue
            try:
                states[name] = self.runner.prepare(system, point)
            except Exception as exc:
                failed[name] = str(exc)
        repeats = self.runner.settings.repeats
        for rep in range(repeats):
            order = list(states) if rep % 2 == 0 else list(reversed(states))
            for name in order:
                if name in failed:
                    continue
                try:
                    self.runner.burst(states[name], last=rep == repeats - 1)
                except Exception as exc:
                    failed[name] = str(exc)
        for name, state in states.items():
            if name not in failed:
                try:
                    m = self.runner.finish(state)
                except Exception as exc:
                    failed[name] = str(exc)
                else:
                    summary = m.summary()
                    if not summary["verified"]:
                        summary["error"] = (
                            f"{m.mismatched_blocks} of {m.verified_blocks} blocks differ"
                        )
                    self._row(name, systems[name].path, point, group, **summary)
        for name, error in failed.items():
            logger.error("%s %s failed: %s", name, point, error)
            self._row(name, systems[name].path, point, group, error=error)


def _placement_rows() -> list[report.Row]:
    """Placement cost per key at 1, 2, 4 and 16 peers (no I/O: a few milliseconds)."""
    from torch_kv_tier.benchmarks.call_cost import placement_us_per_key

    return [
        {"kind": "placement", "peers": n, "us_per_key": placement_us_per_key(n)}
        for n in (1, 2, 4, 16)
    ]


def _loads(loads: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in loads)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the tables; return the exit status."""
    try:
        device = _device(args.device)
        cfg = _config(args)
        if args.token_file and not args.remote:
            raise ValueError("--token-file needs --remote (the embedded server has no token)")
        read_token(args.token_file)
    except (ValueError, OSError) as exc:
        print(f"torch-kv-tier bench: {exc}", file=sys.stderr)
        return 2
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    # vLLM sets this before NIXL loads UCX (it warns when it cannot); set it for every system
    # alike so that all NIXL users run with the same UCX settings.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    quiet_nixl()
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            print(
                f"torch-kv-tier bench: --device {device} but CUDA is not available; "
                "run with --device cpu",
                file=sys.stderr,
            )
            return 2
    from tqdm import tqdm

    bench = _Run(args, cfg, device)
    total = bench.total()
    started = time.monotonic()
    with tqdm(
        total=total, file=sys.stderr, unit="pt", disable=args.no_progress, dynamic_ncols=True
    ) as progress:
        bench.sweep(progress)
    bench.env["loadavg_end"] = os.getloadavg()
    bench.env["seconds"] = round(time.monotonic() - started, 1)
    rows = bench.rows + report.ratio_rows(bench.rows) + _placement_rows()
    print(report.render(rows))
    verify = report_verify.verify_table(rows)
    if verify:
        print(
            "\nVerification on (torch_kv_tier) vs off (torch_kv_tier_noverify), each against "
            "nixl_raw:\nmedian [min-max] of the per-repeat ratios, the three interleaved\n" + verify
        )
    print(
        f"\n{len(rows)} rows in {time.monotonic() - started:.1f} s; "
        f"load average (1/5/15 min) {_loads(bench.env['loadavg_start'])} at start, "
        f"{_loads(bench.env['loadavg_end'])} at end, on {os.cpu_count()} CPUs; "
        f"transports {', '.join(cfg['transports'])}"
    )
    if args.out:
        report.save_json(rows, args.out)
        print(f"results: {args.out}")
    if args.plot:
        report.plot(rows, args.plot)
        print(f"plot: {args.plot}")
    failed = [r for r in rows if r.get("error")]
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torch_kv_tier.benchmarks.bench``: the same as ``torch-kv-tier bench``."""
    parser = argparse.ArgumentParser(prog="torch-kv-tier bench")
    add_arguments(parser)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
