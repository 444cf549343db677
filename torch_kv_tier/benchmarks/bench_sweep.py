"""``BenchSweep``: one ``torch-kv-tier bench`` run's sweep: which systems are measured together,
at which points, on which embedded hosts, and the rows they give (``bench`` parses the command
line and prints the report).

Systems are imported only when they run (vLLM alone takes seconds to import). The tier is
measured interleaved with each reference it is compared to: both are open, and their timed
repeats of a point alternate (A B, B A, ...), so that a change of load on a shared machine hits
both. A system that cannot start (an import it lacks, no GPU) gives ``skipped`` rows; one that
fails gives ``error`` rows, and the sweep goes on with the others.

Threading: one thread; ``UCX_TLS`` is set per transport pass and restored after the sweep.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch_kv_tier.benchmarks import report
from torch_kv_tier.benchmarks.core import Skip, System
from torch_kv_tier.benchmarks.options import usable_cpus
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
PAIRED = ("nixl_raw", "vllm_nixl", "memcpy")  # references the tier is interleaved with
MULTI_HOST = ("torch_kv_tier_2hosts", "torch_kv_tier_4hosts")
NO_TRANSPORT = ("memcpy",)
MAX_GROUP = 3  # systems holding a lease on the first host at once (+1 for vLLM's reader)
MAX_HOSTS = 4


def environment(device: str) -> dict[str, Any]:
    """The machine and software a run measured on (every row carries it)."""
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
        "cpus": usable_cpus(),
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


class BenchSweep:
    """One ``bench`` invocation: the sweep loop, its rows and its progress bar.

    For each transport (UCX default, i.e. shared memory on loopback, then ``tcp``) and block
    length, remote hosts are started; then each *group* of systems is opened together and every
    point is measured on all of them, repeat by repeat in alternating order (A B, B A, ...), so
    that a change of load hits every system of the group alike. Groups pair the tier (and
    ``torch_kv_tier_noverify`` when asked for: the tiers of ``TIERS``, side by side) with each
    reference it is compared to (``nixl_raw``, ``vllm_nixl``, ``memcpy``); the multi-host tiers
    share a group with ``nixl_raw`` at the multi-host points. Other systems run alone.
    """

    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any], device: str) -> None:
        self.args = args
        self.cfg = cfg
        self.device = device
        self.env = environment(device)
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
        """The block sizes of ``transport``'s pass: all of them, up to ``tcp_max_block`` over
        TCP (slow on loopback). Another ``--ucx-tls`` keeps them all."""
        sizes: list[int] = self.cfg["block_sizes"]
        if not _tcp(transport):
            return sizes
        return [bl for bl in sizes if bl <= self.cfg["tcp_max_block"]] or sizes[:1]

    def points(self, transport: str) -> list[Point]:
        batches = self.cfg["tcp_batches"] if _tcp(transport) else self.cfg["batches"]
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


def _tcp(transport: str) -> bool:
    """True when ``transport`` (``shm``, ``tcp`` or a ``--ucx-tls`` list) names UCX's TCP."""
    return "tcp" in transport.split(",")


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
