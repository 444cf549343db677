"""``torch-kv-tier stress``: the long reliability runs, as a table of figures and a JSON file.

Scenarios (``torch_kv_tier/benchmarks/reliability_*.py``; the tests in
``tests/test_reliability.py`` run the same code, short):

* ``peer-death``: SIGKILL a connected server with transfers in flight, ``--trials`` times.
* ``peer-frozen``: the same, but the server is only stopped: the heartbeat must notice.
* ``client-death``: SIGKILL a client process mid-stream; its lease must come back.
* ``soak``: ``--transfers`` store/load transfers through one tier: memory, tables, throughput.
* ``concurrency``: ``--threads`` x ``--calls`` mixed calls on shared keys, every block checked.
* ``close``: ``close()`` with hundreds of transfers in flight to a stopped server.

Exit status: 0 when every figure met its limit and no scenario saw a broken promise, 1
otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from torch_kv_tier.benchmarks.options import (
    add_preset_options,
    duration,
    heartbeat_timeout,
    output_file,
    size,
    usable_cpus,
)
from torch_kv_tier.benchmarks.reliability_common import Outcome
from torch_kv_tier.cli_numbers import integer

logger = logging.getLogger(__name__)

SCENARIOS = ("peer-death", "peer-frozen", "client-death", "soak", "concurrency", "close")
FULL = {
    "trials": 20,
    "frozen_trials": 3,
    "client_trials": 5,
    "transfers": 100_000,
    "threads": 8,
    "calls": 2000,
}
QUICK = {  # the sizes tests/test_reliability.py uses
    "trials": 2,
    "frozen_trials": 1,
    "client_trials": 1,
    "transfers": 3000,
    "threads": 8,
    "calls": 200,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``stress`` subcommand's options."""
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI sizes, for the options not given: " + _describe(QUICK),
    )
    add_preset_options(
        parser,
        [
            ("--trials", integer, "peer-death trials", ""),
            ("--frozen-trials", integer, "peer-frozen trials", ""),
            ("--client-trials", integer, "client-death trials", ""),
            ("--transfers", integer, "soak transfers", ""),
            ("--threads", integer, "concurrency threads", ""),
            ("--calls", integer, "concurrency calls per thread", ""),
        ],
        FULL,
        QUICK,
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=heartbeat_timeout,
        default=10.0,
        help="heartbeat timeout of the doomed servers' sessions, s (default 10, connect's)",
    )
    parser.add_argument(
        "--lease-timeout",
        type=duration,
        default=1.0,
        help="server lease timeout for client-death, s (default %(default)s)",
    )
    parser.add_argument(
        "--soak-tcp",
        action="store_true",
        help="soak over UCX/TCP (transfers really in flight; slower) instead of UCX's choice",
    )
    parser.add_argument(
        "--seed", type=integer, default=0, help="concurrency workload seed (default %(default)s)"
    )
    parser.add_argument(
        "--close-transfers",
        type=integer,
        default=400,
        help="transfers in flight at close() (default %(default)s)",
    )
    parser.add_argument(
        "--close-timeout",
        type=duration,
        default=1.0,
        help="close(timeout), s (default %(default)s)",
    )
    parser.add_argument(
        "--block-len", type=size, default=4096, help="bytes per block (default 4096; e.g. 64K)"
    )
    parser.add_argument(
        "--out", type=output_file, help="write every figure as JSON to this file (default: none)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the chosen scenarios, print the table, write ``--out``; see the module docstring."""
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown or not chosen:
        print(
            f"torch-kv-tier stress: unknown scenarios {unknown}; pick from {SCENARIOS}",
            file=sys.stderr,
        )
        return 2
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:  # (one given is kept, --quick or not)
            setattr(args, name, value)
    sizes = [args.trials, args.frozen_trials, args.client_trials, args.transfers, args.threads]
    sizes += [args.calls, args.close_transfers]
    if min(sizes) <= 0 or min(args.block_len, args.heartbeat_timeout, args.lease_timeout) <= 0:
        print("torch-kv-tier stress: counts, sizes and timeouts must be > 0", file=sys.stderr)
        return 2
    outcomes: list[Outcome] = []
    for name in chosen:
        print(f"-- {name} ...", flush=True)
        outcomes.append(_run_one(name, _scenario(name, args)))
    print(render(outcomes))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(_document(args, outcomes), indent=2) + "\n")
        print(f"figures written to {args.out}")
    return 0 if all(o.ok for o in outcomes) else 1


def _scenario(name: str, args: argparse.Namespace) -> Callable[[], Outcome]:
    # imported here so that `stress --help` stays light
    from torch_kv_tier.benchmarks import (
        reliability_client_faults,
        reliability_concurrency,
        reliability_faults,
        reliability_soak,
    )

    bl = args.block_len
    return {
        "peer-death": lambda: reliability_faults.peer_death(
            args.trials, block_len=bl, heartbeat_timeout_s=args.heartbeat_timeout
        ),
        "peer-frozen": lambda: reliability_faults.peer_death(
            args.frozen_trials,
            block_len=bl,
            frozen=True,
            heartbeat_timeout_s=args.heartbeat_timeout,
        ),
        "client-death": lambda: reliability_client_faults.client_death(
            args.client_trials, block_len=bl, lease_timeout_s=args.lease_timeout
        ),
        "soak": lambda: reliability_soak.soak(args.transfers, block_len=bl, tcp=args.soak_tcp),
        "concurrency": lambda: reliability_concurrency.concurrency(
            args.threads, args.calls, block_len=bl, seed=args.seed
        ),
        "close": lambda: reliability_client_faults.close_under_load(
            args.close_transfers, timeout_s=args.close_timeout, block_len=bl
        ),
    }[name]


def _run_one(name: str, scenario: Callable[[], Outcome]) -> Outcome:
    """Run a scenario; an exception becomes a failed outcome, so the others still run."""
    started = time.monotonic()
    try:
        return scenario()
    except Exception as exc:
        logger.exception("scenario %s crashed", name)
        return Outcome(name, {}, problems=[f"crashed: {exc!r}"], seconds=time.monotonic() - started)


def render(outcomes: list[Outcome]) -> str:
    """The figures as a fixed-width table, then each scenario's problems."""
    rows = [("scenario", "figure", "value", "limit", "")]
    for o in outcomes:
        for f in o.figures:
            rows.append((o.scenario, f.name, f.text(), f.limit, "ok" if f.ok else "FAIL"))
        rows.append((o.scenario, "run time", f"{o.seconds:.1f} s", "", "ok" if o.ok else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for o in outcomes:
        lines += [f"{o.scenario}: {text}" for text in o.problems]
    verdict = "all scenarios passed" if all(o.ok for o in outcomes) else "FAILED"
    return "\n".join([*lines, verdict])


def _document(args: argparse.Namespace, outcomes: list[Outcome]) -> dict[str, object]:
    return {
        "command": "torch-kv-tier stress",
        "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "run"
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": usable_cpus(),
            "load_average": os.getloadavg(),
        },
        "ok": all(o.ok for o in outcomes),
        "outcomes": [asdict(o) for o in outcomes],
    }


def _describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items())
