"""Results of a run: the ratio rows, the stdout tables, and ``--out`` JSON (what is printed in
all, with the targets: :mod:`torch_kv_tier.benchmarks.report_summary`; ``--plot``:
:mod:`torch_kv_tier.benchmarks.report_plot`).

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
NOVERIFY = "torch_kv_tier_noverify"  # the tier with verify=False (``report_verify``)
MULTI_GROUP = "multi-host"
# (reference, column label, interleaved with the tier?)
RATIOS = (("nixl_raw", "raw"), ("vllm_nixl", "vllm"), ("memcpy", "memcpy"))  # all interleaved


def _size(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _group_key(row: Row) -> tuple[Any, ...]:
    return (
        row.get("transport", "shm"),
        row["op"],
        row["pattern"],
        row["block_len"],
        row["batch"],
        row["inflight_requested"],
    )


def _sort_key(k: tuple[Any, ...]) -> tuple[Any, ...]:
    return (k[0] != "shm", k[1] != "write", *k[2:])


def _cell(row: Row | None, fmt: str, field: str = "gbps") -> str:
    if row is None:
        return "-"
    if row.get("skipped"):
        return "skip"
    if row.get("error") or not row.get("verified"):
        return "ERR"
    return fmt.format(row[field])


def _ok(row: Row | None) -> bool:
    return bool(row and row.get("gbps") and row.get("verified") and not row.get("error"))


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    if not lines:
        return "(none)"
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(out)


def _grouped(rows: Iterable[Row]) -> tuple[list[str], dict[tuple[Any, ...], dict[str, Row]]]:
    """Throughput rows by point and system. The tier, measured once per reference it is
    interleaved with, is shown by its run beside ``nixl_raw`` (the others feed the ratios)."""
    systems: list[str] = []
    groups: dict[tuple[Any, ...], dict[str, Row]] = defaultdict(dict)
    for row in rows:
        if row["kind"] != "throughput" or row.get("group") == MULTI_GROUP:
            continue
        if row["system"] not in systems:
            systems.append(row["system"])
        by = groups[_group_key(row)]
        if row["system"] not in by or row.get("group") == "nixl_raw":
            by[row["system"]] = row
    return systems, groups


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def ratio_rows(rows: Sequence[Row]) -> list[Row]:
    """One ``kind="ratio"`` row per tier system, reference and point measured interleaved:
    the per-repeat ratios of GB/s (median, IQR, min-max) and the time the tier adds per call
    and per key over the reference (median of the paired per-repeat differences)."""
    by_group: dict[tuple[Any, ...], dict[str, Row]] = defaultdict(dict)
    for row in rows:
        if row["kind"] == "throughput" and row.get("group"):
            by_group[(row["group"], *_group_key(row))][row["system"]] = row
    out: list[Row] = []
    for (group, *key), systems in by_group.items():
        ref_name = "nixl_raw" if group == MULTI_GROUP else group
        ref = systems.get(ref_name)
        for name, row in systems.items():
            # A system measured in a group of its own (the staged GPU path) has no reference.
            if name == ref_name or not name.startswith(TIER) or not (_ok(row) and _ok(ref)):
                continue
            assert ref is not None
            pairs = list(zip(row["gbps_repeats"], ref["gbps_repeats"], strict=False))
            ratios = [a / b for a, b in pairs if b > 0]
            added = [
                a - b
                for a, b in zip(
                    row["us_per_call_repeats"], ref["us_per_call_repeats"], strict=False
                )
            ]
            if not ratios or not added:
                continue
            q1, q3 = _quartiles(ratios)
            per_call = statistics.median(added)
            out.append(
                {
                    "kind": "ratio",
                    "system": name,
                    "reference": ref_name,
                    "device": row.get("device", "cpu"),
                    "transport": key[0],
                    "op": key[1],
                    "pattern": key[2],
                    "block_len": key[3],
                    "batch": key[4],
                    "inflight_requested": key[5],
                    "ratio_median": statistics.median(ratios),
                    "ratio_q1": q1,
                    "ratio_q3": q3,
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "ratio_repeats": [round(r, 4) for r in ratios],
                    "added_us_per_call": per_call,
                    "added_us_per_key": per_call / key[4],
                    "skipped": None,
                    "error": None,
                }
            )
    return out


def _ratio_index(rows: Iterable[Row]) -> dict[tuple[Any, ...], Row]:
    return {(r["system"], r["reference"], *_group_key(r)): r for r in rows if r["kind"] == "ratio"}


def _ratio_cell(r: Row | None) -> str:
    if r is None:
        return "-"
    return f"{r['ratio_median']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]"


def throughput_table(rows: Iterable[Row]) -> str:
    """GB/s per system, side by side, with the tier's ratios: median [min-max] of the paired
    repeats."""
    rows = list(rows)
    systems, groups = _grouped(rows)
    ratios = _ratio_index(rows)
    header = ["tls", "op", "pattern", "block", "batch", "depth", *systems]
    header += [f"tier/{short}" for _, short in RATIOS]
    lines = []
    capped = False
    for key in sorted(groups, key=_sort_key):
        by = groups[key]
        tls, op, pattern, block_len, batch, depth = key
        fewer = any(r.get("inflight", depth) < depth for r in by.values())
        capped |= fewer
        line = [tls, op, pattern, _size(block_len), str(batch), f"{depth}{'*' if fewer else ''}"]
        line += [_cell(by.get(s), "{:.3f}") for s in systems]
        line += [_ratio_cell(ratios.get((TIER, other, *key))) for other, _ in RATIOS]
        lines.append(line)
    table = _table(header, lines)
    if capped:
        table += (
            "\n* fewer calls in flight than asked: the pools hold fewer calls of this size "
            "(the JSON's inflight has the depth used; raise --pool-mib)"
        )
    return table


def multi_host_table(rows: Iterable[Row]) -> str:
    """The tier over 1, 2 and 4 remote hosts against ``nixl_raw`` to one host, interleaved."""
    lines = []
    for r in sorted(
        (r for r in rows if r["kind"] == "ratio" and r["system"] not in (TIER, NOVERIFY)),
        key=lambda r: (r["transport"] != "shm", r["op"] != "write", r["system"], *_group_key(r)),
    ):
        lines.append(
            [
                r["transport"], r["system"], r["op"], _size(r["block_len"]), str(r["batch"]),
                str(r["inflight_requested"]), _ratio_cell(r), f"{r['added_us_per_call']:.1f}",
            ]
        )  # fmt: skip
    header = ["tls", "system", "op", "block", "batch", "depth", "/raw med [min-max]", "+µs/call"]
    return _table(header, lines)


def overhead_table(rows: Iterable[Row]) -> str:
    """What the tier adds over ``nixl_raw`` per call and per key (paired repeats' median)."""
    lines = []
    for r in sorted(
        (r for r in rows if r["kind"] == "ratio" and r["system"] == TIER),
        key=lambda r: _sort_key(_group_key(r)),
    ):
        if r["reference"] != "nixl_raw":
            continue
        key = _group_key(r)
        lines.append(
            [
                key[0], key[1], key[2], _size(key[3]), str(key[4]), str(key[5]),
                f"{r['added_us_per_call']:.1f}", f"{r['added_us_per_key']:.2f}",
            ]
        )  # fmt: skip
    header = ["tls", "op", "pattern", "block", "batch", "depth", "+µs/call", "+µs/key"]
    return _table(header, lines)


def latency_table(rows: Iterable[Row]) -> str:
    """Per-call completion latency p50/p99 (µs) per system, stamped alike for every system:
    from submit to when the driver saw the call done."""
    systems, groups = _grouped(rows)
    header = ["tls", "op", "pattern", "block", "batch", "depth"]
    header += [f"{s} p50/p99" for s in systems]
    lines = []
    for key in sorted(groups, key=_sort_key):
        by = groups[key]
        tls, op, pattern, block_len, batch, depth = key
        line = [tls, op, pattern, _size(block_len), str(batch), str(depth)]
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
        lines.append(
            [r.get("transport", "shm"), str(r["inflight"]), _size(r["block_len"]), *cells,
             str(r["verified"])]
        )  # fmt: skip
    if not lines:
        return ""
    header = [
        "tls", "in flight", "block", "poll µs/transfer", "done/poll", "poll p50/p99 µs",
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


def save_json(rows: list[Row], path: str) -> None:
    """Write the rows as a JSON list."""
    Path(path).write_text(json.dumps(rows, indent=1) + "\n")
