"""``torch-kv-tier bench``: the tier side by side with raw NIXL, memcpy and peer transports.

For every block length of the sweep the NIXL systems share one remote host (an embedded
``torch-kv-tier serve`` on loopback, or ``--remote``); each system is opened, measured on every
point (op x pattern x batch x depth), verified and closed before the next one starts, so no
system's threads run while another is measured. Results go to stdout (tables, ratios, targets),
``--out`` (JSON rows) and ``--plot`` (PNG). Exit status: 0 when every measured point verified,
1 when a point failed or moved wrong bytes, 2 for bad arguments.
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
from typing import Any

from torch_kv_tier.benchmarks import report
from torch_kv_tier.benchmarks.core import OPS, PATTERNS, Skip, System
from torch_kv_tier.benchmarks.remote import Target, read_token, remote_hosts
from torch_kv_tier.benchmarks.sweep import Point, PointRunner, Settings

logger = logging.getLogger(__name__)

# name -> "module:class"; imported only when the system runs (vLLM alone takes seconds).
SYSTEMS: dict[str, str] = {
    "memcpy": "torch_kv_tier.benchmarks.system_memcpy:Memcpy",
    "nixl_raw": "torch_kv_tier.benchmarks.system_nixl_raw:NixlRaw",
    "vllm_nixl": "torch_kv_tier.benchmarks.system_vllm_nixl:VllmNixl",
    "mooncake_tcp": "torch_kv_tier.benchmarks.system_mooncake:MooncakeTcp",
    "torch_kv_tier": "torch_kv_tier.benchmarks.system_tier:Tier",
    "torch_kv_tier_staged": "torch_kv_tier.benchmarks.system_tier:StagedTier",
}
GPU_ONLY = {"torch_kv_tier_staged"}

QUICK = {
    "block_sizes": [16 << 10, 64 << 10, 256 << 10, 2 << 20],
    "batches": [16],
    "inflight": [2],
    "repeats": 3,
    "min_time": 0.04,
    "warmup": 0.02,
    "working_set_mib": 16,
    "pool_mib": 128,
    "poll_depths": [10, 100, 1000, 10000],
}
FULL = {
    "block_sizes": [16 << 10, 64 << 10, 256 << 10, 2 << 20],
    "batches": [1, 16, 128],
    "inflight": [1, 8],
    "repeats": 5,
    "min_time": 0.25,
    "warmup": 0.1,
    "working_set_mib": 64,
    "pool_mib": 512,
    "poll_depths": [10, 100, 1000, 10000],
}


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    try:
        value = int(number) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16K, 2M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _list(
    parse: Callable[[str], Any], choices: Sequence[str] | None = None
) -> Callable[[str], list[Any]]:
    def parse_list(text: str) -> list[Any]:
        items = [parse(x) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(choices)}")
        return items

    return parse_list


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


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
        type=_list(str, list(SYSTEMS)),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )
    parser.add_argument("--block-sizes", type=_list(_size), help="e.g. 16K,64K,256K,2M")
    parser.add_argument("--batches", type=_list(_positive), help="blocks per call, e.g. 1,16,128")
    parser.add_argument("--inflight", type=_list(_positive), help="calls in flight, e.g. 1,8")
    parser.add_argument("--ops", type=_list(str, OPS), default=list(OPS), help="write,read")
    parser.add_argument(
        "--patterns", type=_list(str, PATTERNS), default=list(PATTERNS), help="contiguous,scattered"
    )
    parser.add_argument("--repeats", type=_positive, help="timed repeats per point (median)")
    parser.add_argument("--min-time", type=float, help="seconds per timed repeat (at least)")
    parser.add_argument(
        "--pool-mib",
        type=_positive,
        help="remote pool per block size, MiB (the local arena is twice this)",
    )
    parser.add_argument(
        "--working-set-mib",
        type=_positive,
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
        type=_list(_positive),
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
        "--ucx-tls", help="set UCX_TLS for this run and the embedded server (e.g. tcp)"
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
        "loadavg_start": os.getloadavg()[0],
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
    """One ``bench`` invocation: the sweep loop, its rows and its progress bar."""

    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any], device: str) -> None:
        self.args = args
        self.cfg = cfg
        self.device = device
        self.env = _environment(device)
        self.rows: list[report.Row] = []
        self.points = [
            Point(op, pattern, 0, batch, depth)
            for op in args.ops
            for pattern in args.patterns
            for batch in cfg["batches"]
            for depth in cfg["inflight"]
        ]
        names = args.systems or [n for n in SYSTEMS if n not in GPU_ONLY or device != "cpu"]
        self.systems: list[str] = names
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

    def _row(self, system: str, path: str, point: Point, block_len: int, **fields: Any) -> None:
        row: report.Row = {
            "kind": "throughput",
            "system": system,
            "path": path,
            "op": point.op,
            "device": self.device,
            "pattern": point.pattern,
            "mean_run": self.args.mean_run if point.pattern == "scattered" else None,
            "block_len": block_len,
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
        sizes = self.cfg["block_sizes"]
        pools = {bl: max(1, (self.cfg["pool_mib"] << 20) // bl) for bl in sizes}
        token = read_token(self.args.token_file)
        progress.set_description("starting remote hosts")
        polls_wanted = not self.args.no_poll_scaling
        with remote_hosts(self.args.remote, pools) as hosts:
            for block_len in sizes:
                host = hosts[block_len]
                target = Target(
                    address=host.address,
                    token=token,
                    device=self.device,
                    block_len=block_len,
                    local_slots=2 * pools[block_len],
                    remote_slots=pools[block_len],
                    embedded=host.embedded,
                    problem=host.problem,
                )
                for name in self.systems:
                    self._system(name, target, progress)
                if polls_wanted:
                    progress.set_description(f"poll scaling {block_len >> 10}K")
                    polls_wanted = not self._poll_scaling(target, last=block_len == sizes[-1])

    def _poll_scaling(self, target: Target, *, last: bool) -> bool:
        """Measure poll scaling at the smallest block size the remote host serves; True once
        rows were recorded (skipped rows only when no block size is served)."""
        from torch_kv_tier.benchmarks.poll_scaling import measure_poll_scaling

        rows = measure_poll_scaling(target, self.cfg["poll_depths"], self.env)
        if all(r["skipped"] for r in rows) and not last:
            return False
        self.rows += rows
        return True

    def _system(self, name: str, target: Target, progress: Any) -> None:
        progress.set_description(f"{name} {target.block_len >> 10}K")
        system: System | None = None
        path = "vram" if self.device != "cpu" else "host"
        try:
            system = _load(name)(target)
            path = system.path
        except Skip as exc:
            reason = str(exc)
            logger.info("%s skipped: %s", name, reason)
            for point in self.points:
                self._row(name, path, point, target.block_len, skipped=reason)
            progress.update(len(self.points))
            return
        except Exception as exc:
            logger.exception("%s failed to start", name)
            for point in self.points:
                self._row(name, path, point, target.block_len, error=f"start failed: {exc}")
            progress.update(len(self.points))
            return
        try:
            for point in self.points:
                self._point(
                    system,
                    name,
                    path,
                    Point(point.op, point.pattern, target.block_len, point.batch, point.inflight),
                )
                progress.update(1)
        finally:
            system.close()

    def _point(self, system: System, name: str, path: str, point: Point) -> None:
        if point.op not in system.ops:
            self._row(name, path, point, point.block_len, skipped=f"{name} has no {point.op} path")
            return
        try:
            m = self.runner.measure(system, point)
        except Exception as exc:
            logger.error("%s %s failed: %s", name, point, exc)
            self._row(name, path, point, point.block_len, error=str(exc))
            return
        summary = m.summary()
        if not summary["verified"]:
            summary["error"] = f"{m.mismatched_blocks} of {m.verified_blocks} blocks differ"
        self._row(name, path, point, point.block_len, **summary)


def _quiet_nixl() -> None:
    """NIXL logs every agent it creates at INFO; keep that out of the bench output (after its
    import, which installs NIXL's own logging configuration)."""
    from torch_kv_tier.transport.ucx_env import apply_ucx_policy

    apply_ucx_policy()
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return  # reported per system
    nixl_logger = logging.getLogger("nixl")
    if nixl_logger.getEffectiveLevel() < logging.WARNING and not logger.isEnabledFor(logging.DEBUG):
        nixl_logger.setLevel(logging.WARNING)


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
    _quiet_nixl()
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
    total = len(bench.systems) * len(bench.points) * len(cfg["block_sizes"])
    started = time.monotonic()
    with tqdm(
        total=total, file=sys.stderr, unit="pt", disable=args.no_progress, dynamic_ncols=True
    ) as progress:
        bench.sweep(progress)
    rows = bench.rows
    print(report.render(rows))
    print(
        f"\n{len(rows)} rows in {time.monotonic() - started:.1f} s; "
        f"load average {bench.env['loadavg_start']:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end; UCX_TLS={bench.env['ucx_tls']}"
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
