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
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from torch_kv_tier.benchmarks import report, report_plot, report_summary, report_verify
from torch_kv_tier.benchmarks.bench_sweep import SYSTEMS, BenchSweep
from torch_kv_tier.benchmarks.core import OPS, PATTERNS
from torch_kv_tier.benchmarks.options import (
    add_output_option,
    add_preset_options,
    duration,
    list_of,
    plot_file,
    positive,
    quiet_nixl,
    size,
    usable_cpus,
)
from torch_kv_tier.benchmarks.remote import read_token
from torch_kv_tier.cli_numbers import integer

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
        "--device",
        default="cpu",
        help="cpu or cuda[:n]: where the source arena lives (default %(default)s)",
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
    parser.add_argument(
        "--ops",
        type=list_of(str, OPS),
        default=list(OPS),
        help="write, read or both (default: both)",
    )
    parser.add_argument(
        "--patterns",
        type=list_of(str, PATTERNS),
        default=list(PATTERNS),
        help="contiguous, scattered or both (default: both)",
    )
    parser.add_argument(
        "--mean-run",
        type=duration,
        default=4.0,
        help="mean run length of the scattered pattern's free list, in blocks (1 = permuted; "
        "default %(default)s)",
    )
    add_preset_options(
        parser,
        [
            ("--block-sizes", list_of(size), "bytes per block", "B"),
            ("--batches", list_of(positive), "blocks per call", ""),
            ("--inflight", list_of(positive), "calls in flight", ""),
            ("--repeats", positive, "timed repeats per point (median)", ""),
            ("--min-time", duration, "least time per timed repeat", "s"),
            (
                "--pool-mib",
                positive,
                "remote pool per block size (the local arena twice it)",
                "MiB",
            ),
            ("--working-set-mib", positive, "bytes cycled per point (bounded by the pool)", "MiB"),
            ("--poll-depths", list_of(positive), "transfers in flight to time polls at", ""),
        ],
        FULL,
        QUICK,
    )
    parser.add_argument(
        "--no-poll-scaling", action="store_true", help="skip the poll-cost measurement"
    )
    parser.add_argument(
        "--remote",
        metavar="HOST:PORT",
        help="use this `torch-kv-tier serve` instead of an embedded one (default: embedded hosts)",
    )
    parser.add_argument("--token-file", help="file holding the remote host's token (default: none)")
    parser.add_argument(
        "--transports",
        type=list_of(str, ["shm", "tcp"]),
        help="shm (UCX's default on loopback), tcp, or both (default: shm for --quick, both "
        "for a full run)",
    )
    parser.add_argument(
        "--ucx-tls",
        help="measure one transport: set UCX_TLS to this for the run and the embedded servers "
        "(default: none, --transports picks)",
    )
    add_output_option(parser, "--out", "the result rows")
    parser.add_argument(
        "--plot", type=plot_file, help="draw GB/s against block size to this PNG (default: none)"
    )
    parser.add_argument(
        "--seed",
        type=integer,
        default=1234,
        help="seed of plans and byte patterns (default %(default)s)",
    )
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
    index = text.removeprefix("cuda:")  # (in ASCII digits: isdigit() takes "٣", torch not)
    if text == "cuda" or (text.startswith("cuda:") and index.isascii() and index.isdigit()):
        return text if ":" in text else "cuda:0"
    raise ValueError(f"--device must be cpu or cuda[:n], got {text!r}")


def _placement_rows() -> list[report.Row]:
    """Placement cost per key at 1, 2, 4 and 16 peers (no I/O: a few milliseconds)."""
    from torch_kv_tier.benchmarks.call_cost import placement_us_per_key

    return [
        {"kind": "placement", "peers": n, "us_per_key": placement_us_per_key(n)}
        for n in (1, 2, 4, 16)
    ]


def _loads(loads: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in loads)


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

    bench = BenchSweep(args, cfg, device)
    total = bench.total()
    started = time.monotonic()
    with tqdm(
        total=total, file=sys.stderr, unit="pt", disable=args.no_progress, dynamic_ncols=True
    ) as progress:
        bench.sweep(progress)
    bench.env["loadavg_end"] = os.getloadavg()
    bench.env["seconds"] = round(time.monotonic() - started, 1)
    rows = bench.rows + report.ratio_rows(bench.rows) + _placement_rows()
    print(report_summary.render(rows))
    verify = report_verify.verify_table(rows)
    if verify:
        print(
            "\nVerification on (torch_kv_tier) vs off (torch_kv_tier_noverify), each against "
            "nixl_raw:\nmedian [min-max] of the per-repeat ratios, the three interleaved\n" + verify
        )
    print(
        f"\n{len(rows)} rows in {time.monotonic() - started:.1f} s; "
        f"load average (1/5/15 min) {_loads(bench.env['loadavg_start'])} at start, "
        f"{_loads(bench.env['loadavg_end'])} at end, on {usable_cpus()} CPUs; "
        f"transports {', '.join(cfg['transports'])}"
    )
    if args.out:
        report.save_json(rows, args.out)
        print(f"results: {args.out}")
    if args.plot:
        report_plot.plot(rows, args.plot)
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
