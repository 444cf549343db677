"""The end of a run on stdout: every table of :mod:`torch_kv_tier.benchmarks.report` and the
issue's targets against what the run measured (reported, never asserted)."""

from __future__ import annotations

import statistics
from typing import Any

from torch_kv_tier.benchmarks.report import (
    NOVERIFY,
    TIER,
    Row,
    latency_table,
    multi_host_table,
    overhead_table,
    poll_table,
    skipped,
    throughput_table,
)


def _medians(rows: list[Row], reference: str, want: Any) -> list[float]:
    return [
        r["ratio_median"]
        for r in rows
        if r["kind"] == "ratio"
        and r["system"] == TIER
        and r["reference"] == reference
        and want(r["op"], r["pattern"], r["block_len"], r["batch"])
    ]


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets against what this run measured (reported, never asserted).

    Ratio targets judge each point by the median of its paired repeats."""

    def big(op: str, pattern: str, block_len: int, batch: int) -> bool:
        return block_len >= 64 << 10 and batch >= 16

    def small(op: str, pattern: str, block_len: int, batch: int) -> bool:
        return block_len == 16 << 10 and batch >= 16

    def scattered_small(op: str, pattern: str, block_len: int, batch: int) -> bool:
        return block_len == 16 << 10 and pattern == "scattered"

    def anywhere(op: str, pattern: str, block_len: int, batch: int) -> bool:
        return True

    raw, vllm = "nixl_raw", "vllm_nixl"
    checks = [
        (f"{TIER}/{raw} >= 0.95, blocks >= 64 KiB, >= 16 per call", _medians(rows, raw, big), 0.95),
        (f"{TIER}/{raw} >= 0.80, 16 KiB blocks, >= 16 per call", _medians(rows, raw, small), 0.80),
        (f"{TIER}/{raw} >= 0.90 (stretch), 16 KiB, >= 16/call", _medians(rows, raw, small), 0.90),
        (f"{TIER}/vllm_nixl >= 1.0 wherever measured", _medians(rows, vllm, anywhere), 1.0),
        (
            f"{TIER}/vllm_nixl >= 1.2, scattered 16 KiB writes",
            _medians(rows, "vllm_nixl", scattered_small),
            1.2,
        ),
        (
            f"{TIER}/memcpy >= 0.80 on a GPU arena (pinned D2H is the ceiling)",
            _medians(
                [r for r in rows if r.get("device", "cpu").startswith("cuda")],
                "memcpy",
                lambda o, p, bl, b: b >= 16,
            ),
            0.80,
        ),
    ]  # fmt: skip
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
    placement = {r["peers"]: r["us_per_key"] for r in rows if r["kind"] == "placement"}
    if placement:
        at4 = placement.get(4)
        figures = ", ".join(f"{p} peers {us:.2f}" for p, us in sorted(placement.items()))
        verdict = "not measured" if at4 is None else ("met" if at4 <= 0.5 else "MISSED")
        out.append(f"  placement <= 0.5 µs/key at 4 peers ({figures}): {verdict}")
    for transport in dict.fromkeys(r.get("transport", "shm") for r in rows):
        polls = [
            r
            for r in rows
            if r["kind"] == "poll_scaling"
            and r.get("verified")
            and r.get("transport", "shm") == transport
        ]
        if len(polls) >= 2:
            lo = min(polls, key=lambda r: r["inflight"])
            hi = max(polls, key=lambda r: r["inflight"])
            paired = zip(hi["poll_us_per_round"], lo["poll_us_per_round"], strict=True)
            ratios = [h / max(lo_us, 1e-9) for h, lo_us in paired]  # the runs of one round
            growth = statistics.median(ratios)
            verdict = "met" if growth <= 2.0 else "MISSED"
            out.append(
                f"  [{transport}] poll cost per completed transfer flat from {lo['inflight']} to "
                f"{hi['inflight']} in flight: {lo['poll_us_per_transfer']:.2f} -> "
                f"{hi['poll_us_per_transfer']:.2f} µs (x{growth:.2f} [{min(ratios):.2f}-"
                f"{max(ratios):.2f}], median of per-round ratios; met when <= x2): {verdict}"
            )
    return out


def render(rows: list[Row]) -> str:
    """Everything printed on stdout at the end of a run."""
    parts = [
        "Throughput (GB/s, median of repeats; depth = calls in flight; tier/raw and tier/vllm:",
        "median [min-max] of the per-repeat ratios, the systems interleaved repeat by repeat)",
        throughput_table(rows),
    ]
    if any(r["kind"] == "ratio" for r in rows):
        parts += [
            "",
            "What the tier adds over nixl_raw (median of paired repeats)",
            overhead_table(rows),
        ]
    if any(r["kind"] == "ratio" and r["system"] not in (TIER, NOVERIFY) for r in rows):
        parts += [
            "",
            "The tier over several remote hosts vs nixl_raw to one",
            multi_host_table(rows),
        ]
    parts += ["", "Per-call latency (µs, submit to seen done by the driver)", latency_table(rows)]
    polls = poll_table(rows)
    if polls:
        parts += ["", "Poll cost of the tier's transport vs transfers in flight", polls]
    notes = skipped(rows)
    if notes:
        parts += ["", "Not measured:", *(f"  {n}" for n in notes)]
    parts += ["", "Targets (reported, not asserted):", *targets(rows)]
    return "\n".join(parts)
