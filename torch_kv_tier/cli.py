"""``torch-kv-tier`` command line: ``serve``, ``bench`` and ``stress`` subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# subcommand -> (module providing add_arguments/run, help)
_COMMANDS = {
    "serve": ("torch_kv_tier.remote.server", "run a remote host: a NIXL-registered DRAM pool"),
    "bench": ("benchmarks.bench", "measure throughput against raw NIXL and memcpy"),
    "stress": ("benchmarks.soak", "long reliability runs: soak, peer death, concurrency"),
}


def build_parser() -> argparse.ArgumentParser:
    """The full parser; each subcommand's module adds its own arguments."""
    parser = argparse.ArgumentParser(prog="torch-kv-tier", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level for stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns its exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
