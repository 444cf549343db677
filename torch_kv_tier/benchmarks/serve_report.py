"""Summary, targets, table and plot of the serving benchmark
(:mod:`torch_kv_tier.benchmarks.serve_bench`). Pure functions over its JSON; the plot needs
matplotlib.

Targets (issue 19), each printed met/missed:

- per scenario and concurrency: TTFT p50 and p99 with the tier (replica B) <= without it
  (replica C, recompute);
- per scenario, at concurrency 1: recompute p50 / tier p50 >= 2;
- per scenario: chunks the tier read / chunks it delivered <= 1.05 (delivered: the prompt
  tokens vLLM counted as loaded by the connector, in chunks; vLLM's own ``chunk_hits`` counts
  lookup hits, including chunks that were promoted and then lost before use);
- per replica with the tier, a clean shutdown: no process killed after vLLM's grace, no
  engine or worker that died, no exception through ``torch_kv_tier`` at any time, and no
  ``EngineDeadError`` while serving. An ``EngineDeadError`` logged after SIGTERM is printed
  beside, with the same count for the replicas without the tier: vLLM 0.32's
  ``AsyncLLM.shutdown`` stops the engine core before it cancels its output handler, which then
  logs one on an orderly shutdown, with or without offloading (vllm-project/vllm#48745).

Beside them, for attribution only (no target): replica D's TTFT (vLLM's CPU offloading with no
secondary tier), i.e. what the offloading path costs before the remote tier adds anything; the
p50 speedup of each round (B's and C's runs of it paired), whose range says how much a pooled
figure near its target owes to the round it fell in; and each round's slowest request with the
tier over the slowest of the same round recomputed, whose range says the same of a p99, the
slowest round's figure (at concurrency 16 with an 8 MiB tier, 0.55 to 1.95 over 64 rounds).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from torch_kv_tier.integrations.vllm.admission_stats import REFUSAL_REASONS

CHUNK_BYTES = 32768
TOKENS_PER_CHUNK = 32
SPEEDUP_AT_1 = 2.0
READS_PER_HIT = 1.05
_TIER_ROLES = ("warm", "tier")  # the replicas with the remote tier (A and B)
# ``Replica.log_counts`` names that make a tier replica's shutdown unclean (the serving part
# and the shutdown part; an EngineDeadError only while serving), and vLLM#48745's line.
_UNCLEAN = (
    "sigterm_after_grace",
    "sigterm_after_grace_in_shutdown",
    "died",
    "died_in_shutdown",
    "tier_traceback",
    "tier_traceback_in_shutdown",
    "engine_dead",
)
_SPURIOUS = "engine_dead_in_shutdown"
# Per-round counters the benchmark reads from a replica's /metrics (increase over the round).
COUNTERS = (
    "tier_hits",
    "tier_read_bytes",
    "allocation_failures",
    "refused_promotions",
    *(f"refused_{reason}" for reason in REFUSAL_REASONS),
    "lost_promotions",
    "connector_hit_tokens",
    "prompt_tokens",
)
# Per-round gauges it reads at the round's end: promoted chunks still held in vLLM's CPU tier
# (0 once every request of the round finished; more is a leak).
GAUGES = ("held_promotions",)


def summarize(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per scenario and concurrency: percentiles over every request of the level's
    rounds, mean request throughput, counters summed."""
    rows = []
    for scenario in scenarios:
        replicas = scenario["replicas"]
        tier_rounds, recompute_rounds = replicas["tier"]["rounds"], replicas["recompute"]["rounds"]
        offload_rounds = replicas.get("offload", {}).get("rounds", [])  # absent before D existed
        for concurrency in dict.fromkeys(r["concurrency"] for r in tier_rounds):
            tier_level = [r for r in tier_rounds if r["concurrency"] == concurrency]
            recompute_level = [r for r in recompute_rounds if r["concurrency"] == concurrency]
            tier, recompute = _pool(tier_level), _pool(recompute_level)
            mine = [r for r in offload_rounds if r["concurrency"] == concurrency]
            offload = _pool(mine) if mine else {"p50_ms": None, "p99_ms": None}
            reads = tier["tier_read_bytes"] / CHUNK_BYTES
            delivered = tier["connector_hit_tokens"] / TOKENS_PER_CHUNK
            rows.append(
                {
                    "scenario": scenario["name"],
                    "concurrency": concurrency,
                    "requests": len(tier["ttfts_s"]),
                    "tier_p50_ms": tier["p50_ms"],
                    "tier_p99_ms": tier["p99_ms"],
                    "recompute_p50_ms": recompute["p50_ms"],
                    "recompute_p99_ms": recompute["p99_ms"],
                    "offload_p50_ms": offload["p50_ms"],
                    "offload_p99_ms": offload["p99_ms"],
                    "speedup_p50": recompute["p50_ms"] / tier["p50_ms"],
                    "speedup_p99": recompute["p99_ms"] / tier["p99_ms"],
                    "speedup_p50_per_round": _per_round(tier_level, recompute_level, _p50_speedup),
                    "slowest_ratio_per_round": _per_round(
                        tier_level, recompute_level, _slowest_ratio
                    ),
                    "tier_req_per_s": tier["request_throughput"],
                    "recompute_req_per_s": recompute["request_throughput"],
                    "tier_hits": tier["tier_hits"],
                    "tier_reads": reads,
                    "delivered": delivered,
                    "reads_per_delivered": reads / delivered if delivered else None,
                    "allocation_failures": tier["allocation_failures"],
                    "refused_promotions": tier["refused_promotions"],
                    "refused_by_reason": {
                        reason: tier[f"refused_{reason}"] for reason in REFUSAL_REASONS
                    },
                    "lost_promotions": tier["lost_promotions"],
                    "held_promotions_after_rounds": max(
                        (r.get("held_promotions", 0) for r in tier_level), default=0
                    ),
                    "tokens_from_connector": tier["connector_hit_tokens"],
                    "prompt_tokens": tier["prompt_tokens"],
                    "first_requests_ttft_ms": {
                        role: 1e3 * max(replicas[role]["first_requests"]["ttfts_s"])
                        for role in ("tier", "recompute", "offload")
                        if role in replicas
                    },
                    "shutdown_s": {r: replicas[r]["shutdown_s"] for r in replicas},
                    "log": {r: replicas[r]["log"] for r in replicas},
                }
            )
    return rows


def _per_round(
    tier_rounds: list[dict[str, Any]],
    recompute_rounds: list[dict[str, Any]],
    ratio: Callable[[list[float], list[float]], float],
) -> list[float]:
    """``ratio(tier TTFTs, recompute TTFTs)`` of each round, B's and C's runs of it paired (they
    take each round in turn, so a pair shares the machine's state): the spread says how much of
    a pooled figure is the round it fell in."""
    return [
        float(ratio(t["ttfts_s"], c["ttfts_s"]))
        for t, c in zip(tier_rounds, recompute_rounds, strict=True)
    ]


def _p50_speedup(tier: list[float], recompute: list[float]) -> float:
    return float(np.median(recompute) / np.median(tier))


def _slowest_ratio(tier: list[float], recompute: list[float]) -> float:
    """The slowest request with the tier over the slowest recomputed (above 1: the tier's was
    slower)."""
    return max(tier) / max(recompute)


def _pool(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one level as one: TTFTs pooled, throughput averaged, counters summed."""
    ttfts = [t for r in rounds for t in r["ttfts_s"]]
    pooled: dict[str, Any] = {
        "ttfts_s": ttfts,
        "p50_ms": 1e3 * float(np.percentile(ttfts, 50)),
        "p99_ms": 1e3 * float(np.percentile(ttfts, 99)),
        "request_throughput": float(np.mean([r["request_throughput"] for r in rounds])),
    }
    for name in COUNTERS:
        pooled[name] = sum(r.get(name, 0) for r in rounds)
    return pooled


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(what: str, value: float, limit: float, met: bool) -> None:
        out.append({"target": what, "value": value, "limit": limit, "met": bool(met)})

    for row in rows:
        where = f"{row['scenario']}, c={row['concurrency']}"
        for p in ("p50", "p99"):
            tier, recompute = row[f"tier_{p}_ms"], row[f"recompute_{p}_ms"]
            add(f"{where}: TTFT {p} tier <= recompute (ms)", tier, recompute, tier <= recompute)
        if row["concurrency"] == 1:
            speedup = row["speedup_p50"]
            add(
                f"{where}: p50 speedup >= {SPEEDUP_AT_1}x",
                speedup,
                SPEEDUP_AT_1,
                speedup >= SPEEDUP_AT_1,
            )
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == scenario]
        delivered = sum(r["delivered"] for r in mine)
        reads = sum(r["tier_reads"] for r in mine)
        ratio = reads / delivered if delivered else float("inf")
        add(
            f"{scenario}: reads per delivered hit <= {READS_PER_HIT}",
            ratio,
            READS_PER_HIT,
            ratio <= READS_PER_HIT,
        )
        log = mine[0]["log"]
        bad = sum(log[r].get(name, 0) for r in _TIER_ROLES for name in _UNCLEAN)
        shutdown = sum(log[r].get(_SPURIOUS, 0) for r in _TIER_ROLES)
        vanilla = sum(log[r].get(_SPURIOUS, 0) for r in log if r not in _TIER_ROLES)
        add(
            f"{scenario}: clean shutdowns (lines of A and B killed after grace, died, through "
            f"torch_kv_tier or EngineDeadError while serving; EngineDeadError after SIGTERM, "
            f"vLLM#48745: A and B {shutdown}, C and D without the tier {vanilla})",
            bad,
            0,
            bad == 0,
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the summary."""
    lines = [
        "| scenario | conc | TTFT p50 tier / recompute (ms) "
        "| p99 tier / recompute (ms) (per-round slowest, tier / recompute, min-max) "
        "| p50 / p99 offload only (ms) | p50 speedup (per-round min-max) | req/s tier / recompute "
        "| chunks read / delivered | lookup hits | alloc. failures "
        "| refused (busy/pressure/budget) / lost "
        "| prompt tokens from tier |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        by_reason = r.get("refused_by_reason")  # absent from results before it was counted
        reasons = "/".join(f"{n:.0f}" for n in by_reason.values()) if by_reason else "-"
        offload = (
            f"{r['offload_p50_ms']:.0f} / {r['offload_p99_ms']:.0f}"
            if r.get("offload_p50_ms") is not None
            else "-"
        )
        lines.append(
            f"| {r['scenario']} | {r['concurrency']} "
            f"| {r['tier_p50_ms']:.0f} / {r['recompute_p50_ms']:.0f} "
            f"| {r['tier_p99_ms']:.0f} / {r['recompute_p99_ms']:.0f} "
            f"({_spread(r['slowest_ratio_per_round'])}) | {offload} "
            f"| {r['speedup_p50']:.2f}x ({_spread(r['speedup_p50_per_round'])}) "
            f"| {r['tier_req_per_s']:.2f} / {r['recompute_req_per_s']:.2f} "
            f"| {r['tier_reads']:.0f} / {r['delivered']:.0f} | {r['tier_hits']:.0f} "
            f"| {r['allocation_failures']:.0f} "
            f"| {r['refused_promotions']:.0f} ({reasons}) / {r['lost_promotions']:.0f} "
            f"| {r['tokens_from_connector']:.0f} of {r['prompt_tokens']:.0f} |"
        )
    return "\n".join(lines)


def _spread(ratios: list[float]) -> str:
    """``min-max`` of per-round ratios."""
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def target_lines(results: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.3g} "
        f"(limit {t['limit']:.3g})"
        for t in results
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT p50 and p99, tier vs recompute (and p50 with offloading only, when measured), per
    concurrency; one panel per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        mine = [r for r in rows if r["scenario"] == scenario]
        xs = range(len(mine))
        bars = [
            ("tier_p50_ms", "tier p50"),
            ("recompute_p50_ms", "recompute p50"),
            ("offload_p50_ms", "offload only p50"),
            ("tier_p99_ms", "tier p99"),
            ("recompute_p99_ms", "recompute p99"),
        ]
        bars = [(k, label) for k, label in bars if all(r.get(k) is not None for r in mine)]
        width = 0.8 / len(bars)
        for offset, (key, label) in enumerate(bars):
            shift = (offset - (len(bars) - 1) / 2) * width
            ax.bar([x + shift for x in xs], [r[key] for r in mine], width, label=label)
        ax.set_xticks(list(xs), [f"c={r['concurrency']}" for r in mine])
        ax.set_title(scenario, fontsize=9)
        ax.set_ylabel("TTFT (ms)")
    axes[0][0].legend(fontsize=7)
    c = result["conditions"]
    fig.suptitle(
        f"vLLM {c['vllm']} bench serve, {c['num_prompts']} random prompts of {c['input_len']} "
        f"tokens per level, {c['machine']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
