"""Results of a run: the stdout tables with ratios and targets, ``--out`` JSON, ``--plot`` PNG.

Rows are plain dicts (the JSON schema). Every throughput row has ``kind="throughput"``,
``system``, ``path``, ``op``, ``device``, ``pattern``, ``block_len``, ``batch``, ``inflight``
(effective depth), ``inflight_requested``, ``gbps``, ``blocks_per_s``, ``p50_us``, ``p99_us``,
``verified``, plus ``skipped`` or ``error`` (a reason) when the point produced no number.
Poll-scaling rows have ``kind="poll_scaling"`` and the same keys, plus ``poll_us_per_transfer``.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

TIER = "torch_kv_tier"
RATIOS = (("nixl_raw", "raw"), ("memcpy", "memcpy"), ("vllm_nixl", "vllm"))


def _size(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _group_key(row: Row) -> tuple[Any, ...]:
    return (row["op"], row["pattern"], row["block_len"], row["batch"], row["inflight_requested"])


def _cell(row: Row | None, fmt: str, field: str = "gbps") -> str:
    if row is None:
        return "-"
    if row.get("skipped"):
        return "skip"
    if row.get("error") or not row.get("verified"):
        return "ERR"
    return fmt.format(row[field])


def ratio(a: Row | None, b: Row | None) -> float | None:
    """``a.gbps / b.gbps`` when both are verified numbers."""
    if a is None or b is None:
        return None
    if not (a.get("gbps") and b.get("gbps") and a.get("verified") and b.get("verified")):
        return None
    return float(a["gbps"]) / float(b["gbps"])


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(out)


def _grouped(rows: Iterable[Row]) -> tuple[list[str], dict[tuple[Any, ...], dict[str, Row]]]:
    systems: list[str] = []
    groups: dict[tuple[Any, ...], dict[str, Row]] = defaultdict(dict)
    for row in rows:
        if row["kind"] != "throughput":
            continue
        if row["system"] not in systems:
            systems.append(row["system"])
        groups[_group_key(row)][row["system"]] = row
    return systems, groups


def throughput_table(rows: Iterable[Row]) -> str:
    """GB/s per system, side by side, with the tier's ratios to the floor, ceiling and reference."""
    systems, groups = _grouped(rows)
    header = ["op", "pattern", "block", "batch", "depth", *systems]
    header += [f"{TIER}/{short}" for _, short in RATIOS]
    lines = []
    capped = False
    for key in sorted(groups, key=lambda k: (k[0] != "write", k[1], k[2], k[3], k[4])):
        by = groups[key]
        op, pattern, block_len, batch, depth = key
        fewer = any(r.get("inflight", depth) < depth for r in by.values())
        capped |= fewer
        line = [op, pattern, _size(block_len), str(batch), f"{depth}{'*' if fewer else ''}"]
        line += [_cell(by.get(s), "{:.3f}") for s in systems]
        for other, _ in RATIOS:
            r = ratio(by.get(TIER), by.get(other))
            line.append("-" if r is None else f"{r:.2f}")
        lines.append(line)
    table = _table(header, lines)
    if capped:
        table += (
            "\n* fewer calls in flight than asked: the pools hold fewer calls of this size "
            "(the JSON's inflight has the depth used; raise --pool-mib)"
        )
    return table


def latency_table(rows: Iterable[Row]) -> str:
    """Per-call completion latency p50/p99 (µs) per system."""
    systems, groups = _grouped(rows)
    header = ["op", "pattern", "block", "batch", "depth", *(f"{s} p50/p99" for s in systems)]
    lines = []
    for key in sorted(groups, key=lambda k: (k[0] != "write", k[1], k[2], k[3], k[4])):
        by = groups[key]
        op, pattern, block_len, batch, depth = key
        line = [op, pattern, _size(block_len), str(batch), str(depth)]
        for s in systems:
            row = by.get(s)
            cell = _cell(row, "")
            if cell == "":
                assert row is not None
                cell = f"{row['p50_us']:.0f}/{row['p99_us']:.0f}"
            line.append(cell)
        lines.append(line)
    return _table(header, lines)


def poll_table(rows: Iterable[Row]) -> str:
    """Poll cost per completed transfer against the number of transfers in flight."""
    lines = []
    for r in rows:
        if r["kind"] != "poll_scaling":
            continue
        if r.get("skipped") or r.get("error"):
            cells = ["skip" if r.get("skipped") else "ERR"] * 4
        else:
            cells = [
                f"{r['poll_us_per_transfer']:.2f}",
                f"{r['completed_per_poll']:.1f}",
                f"{r['p50_us']:.0f}/{r['p99_us']:.0f}",
                f"{r['submit_us_per_transfer']:.2f}",
            ]
        lines.append([str(r["inflight"]), _size(r["block_len"]), *cells, str(r["verified"])])
    if not lines:
        return ""
    header = [
        "in flight", "block", "poll µs/transfer", "done/poll", "poll p50/p99 µs",
        "submit µs/transfer", "verified",
    ]  # fmt: skip
    return _table(header, lines)


def skipped(rows: Iterable[Row]) -> list[str]:
    """One line per (system, reason) for rows that were skipped or failed."""
    seen: dict[tuple[str, str], int] = {}
    for row in rows:
        reason = row.get("skipped") or row.get("error")
        if reason:
            label = "skipped" if row.get("skipped") else "ERROR"
            k = (row["system"], f"{label}: {reason}")
            seen[k] = seen.get(k, 0) + 1
    return [f"{system}: {reason} ({n} points)" for (system, reason), n in seen.items()]


def _ratios(rows: list[Row], other: str, want: Any) -> list[float]:
    _, groups = _grouped(rows)
    out = []
    for key, by in groups.items():
        op, pattern, block_len, batch, _ = key
        if want(op, pattern, block_len, batch):
            r = ratio(by.get(TIER), by.get(other))
            if r is not None:
                out.append(r)
    return out


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets against what this run measured (reported, never asserted)."""
    checks = [
        (
            f"{TIER}/nixl_raw >= 0.95, blocks >= 64 KiB, >= 16 blocks per call",
            _ratios(rows, "nixl_raw", lambda o, p, bl, b: bl >= 64 << 10 and b >= 16),
            0.95,
        ),
        (
            f"{TIER}/nixl_raw >= 0.90, 16 KiB blocks, >= 16 blocks per call",
            _ratios(rows, "nixl_raw", lambda o, p, bl, b: bl == 16 << 10 and b >= 16),
            0.90,
        ),
        (
            f"{TIER}/vllm_nixl >= 1.5, 16 KiB blocks, scattered",
            _ratios(rows, "vllm_nixl", lambda o, p, bl, b: bl == 16 << 10 and p == "scattered"),
            1.5,
        ),
        (
            f"{TIER}/memcpy >= 0.80 on a GPU arena (pinned D2H is the ceiling)",
            _ratios(
                [r for r in rows if r.get("device", "cpu").startswith("cuda")],
                "memcpy",
                lambda o, p, bl, b: b >= 16,
            ),
            0.80,
        ),
    ]
    out = []
    for label, values, goal in checks:
        if not values:
            out.append(f"  {label}: not measured in this run")
            continue
        below = sum(v < goal for v in values)
        verdict = "met" if below == 0 else f"MISSED at {below} of {len(values)} points"
        out.append(
            f"  {label}: min {min(values):.2f}, median {statistics.median(values):.2f} over "
            f"{len(values)} points: {verdict}"
        )
    polls = [r for r in rows if r["kind"] == "poll_scaling" and r.get("verified")]
    if len(polls) >= 2:
        lo = min(polls, key=lambda r: r["inflight"])
        hi = max(polls, key=lambda r: r["inflight"])
        growth = hi["poll_us_per_transfer"] / max(lo["poll_us_per_transfer"], 1e-9)
        out.append(
            f"  poll cost per completed transfer flat from {lo['inflight']} to {hi['inflight']} "
            f"in flight: {lo['poll_us_per_transfer']:.2f} -> {hi['poll_us_per_transfer']:.2f} µs "
            f"(x{growth:.2f})"
        )
    return out


def render(rows: list[Row]) -> str:
    """Everything printed on stdout at the end of a run."""
    parts = [
        "Throughput (GB/s, median of repeats; depth = calls in flight)",
        throughput_table(rows),
    ]
    parts += ["", "Per-call latency (µs, submit to completion)", latency_table(rows)]
    polls = poll_table(rows)
    if polls:
        parts += ["", "Poll cost of the tier's transport vs transfers in flight", polls]
    notes = skipped(rows)
    if notes:
        parts += ["", "Not measured:", *(f"  {n}" for n in notes)]
    parts += ["", "Targets (reported, not asserted):", *targets(rows)]
    return "\n".join(parts)


def save_json(rows: list[Row], path: str) -> None:
    """Write the rows as a JSON list."""
    Path(path).write_text(json.dumps(rows, indent=1) + "\n")


def plot(rows: list[Row], path: str) -> None:
    """GB/s against block size, one line per system, write and read panels (matplotlib Agg).

    Shown: the largest requested depth and, among batches, 16 when measured (else the largest);
    solid lines are the contiguous pattern, dashed the scattered one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tput = [r for r in rows if r["kind"] == "throughput"]
    if not tput:
        raise ValueError("no throughput rows to plot")
    batches = sorted({r["batch"] for r in tput})
    batch = 16 if 16 in batches else batches[-1]
    depth = max(r["inflight_requested"] for r in tput)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    systems = list(dict.fromkeys(r["system"] for r in tput))
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    for ax, op in zip(axes, ("write", "read"), strict=True):
        for system in systems:
            for pattern, style in (("contiguous", "-"), ("scattered", "--")):
                pts = sorted(
                    (r["block_len"], r["gbps"])
                    for r in tput
                    if r["system"] == system
                    and r["op"] == op
                    and r["pattern"] == pattern
                    and r["batch"] == batch
                    and r["inflight_requested"] == depth
                    and r.get("verified")
                )
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(
                        xs,
                        ys,
                        style,
                        marker="o",
                        color=colors[system],
                        label=f"{system} ({pattern})",
                    )
        ax.set_xscale("log", base=2)
        ticks = sorted({r["block_len"] for r in tput})
        ax.set_xticks(ticks, [_size(t) for t in ticks])
        ax.set_title(f"{op} ({'offload' if op == 'write' else 'load back'})")
        ax.set_xlabel("block size")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    labelled: dict[str, Any] = {}
    for ax in axes:  # systems without a read path appear in the write panel only
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    axes[1].legend(list(labelled.values()), list(labelled), fontsize=7, loc="best")
    device = tput[0]["device"]
    fig.suptitle(f"torch-kv-tier bench: {device}, {batch} blocks per call, depth {depth}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
