"""The serving benchmark's report, without a vLLM server: the shutdown verdict (issue 19, item 5):
a replica's log is counted apart while serving and after SIGTERM, and the "clean shutdown" target
fails on what the tier could cause, not on vLLM 0.32's own ``EngineDeadError`` of an orderly
shutdown (vllm-project/vllm#48745), which replicas without the tier log as well; and the
per-round speedups and slowest-request ratios beside the pooled figures."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from torch_kv_tier.benchmarks.serve_replicas import Replica
from torch_kv_tier.benchmarks.serve_report import COUNTERS, summarize, table, targets

SPURIOUS = "ERROR [async_llm.py:906] AsyncLLM output_handler failed.\nEngineDeadError: x\n"
TRACEBACK = 'Traceback (most recent call last):\n  File "/x/torch_kv_tier/manager.py", line 1\n'


def _replica(tmp_path: Path, serving: str, after_sigterm: str) -> dict[str, int]:
    """A stand-in server that logs ``serving``, then ``after_sigterm`` when SIGTERMed."""
    log_path = tmp_path / "replica.log"
    script = (
        "import signal, sys, time\n"
        f"sys.stdout.write({serving!r}); sys.stdout.flush()\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (sys.stdout.write({after_sigterm!r}), "
        "sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    log = log_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    replica = Replica(proc, 0, log_path, log)
    deadline = time.monotonic() + 30
    while b"ready" not in log_path.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    replica.stop()
    return replica.log_counts()


def _clean_shutdown(logs: dict[str, dict[str, int]]) -> dict[str, Any]:
    row = {
        "scenario": "s",
        "concurrency": 4,
        "tier_p50_ms": 1.0,
        "tier_p99_ms": 1.0,
        "recompute_p50_ms": 2.0,
        "recompute_p99_ms": 2.0,
        "delivered": 1,
        "tier_reads": 1,
        "log": logs,
    }
    return next(t for t in targets([row]) if "clean shutdowns" in t["target"])


def test_a_log_is_counted_apart_while_serving_and_after_sigterm(tmp_path: Path) -> None:
    counts = _replica(tmp_path, "INFO serving\n", SPURIOUS)
    assert counts["engine_dead"] == 0 and counts["engine_dead_in_shutdown"] == 1
    counts = _replica(tmp_path, SPURIOUS + TRACEBACK, "")
    assert counts["engine_dead"] == 1 and counts["tier_traceback"] == 1
    assert counts["engine_dead_in_shutdown"] == 0


def test_only_what_the_tier_could_cause_fails_a_clean_shutdown(tmp_path: Path) -> None:
    quiet = _replica(tmp_path, "INFO serving\n", "INFO bye\n")
    vllm_48745 = _replica(tmp_path, "INFO serving\n", SPURIOUS)
    verdict = _clean_shutdown({"warm": vllm_48745, "tier": quiet, "recompute": vllm_48745})
    assert verdict["met"] and "A and B 1, C and D without the tier 1" in verdict["target"]
    dead_while_serving = _replica(tmp_path, SPURIOUS, "")
    assert not _clean_shutdown({"warm": quiet, "tier": dead_while_serving})["met"]
    through_the_tier = _replica(tmp_path, "INFO serving\n", TRACEBACK)
    assert not _clean_shutdown({"warm": quiet, "tier": through_the_tier})["met"]


def _replica_rounds(p50s_ms: list[float]) -> dict[str, Any]:
    """A replica's results at concurrency 4: one round per p50, three requests each."""
    rounds = [
        {
            "concurrency": 4,
            "ttfts_s": [p50 / 2e3, p50 / 1e3, p50 / 5e2],
            "request_throughput": 1.0,
            **dict.fromkeys(COUNTERS, 0),
            "tier_read_bytes": 32768,
            "connector_hit_tokens": 32,
        }
        for p50 in p50s_ms
    ]
    return {"first_requests": {"ttfts_s": [0.1]}, "rounds": rounds, "shutdown_s": 1.0, "log": {}}


def test_the_report_pairs_each_round_of_the_tier_with_the_same_round_recomputed() -> None:
    scenario = {
        "name": "s",
        "replicas": {"tier": _replica_rounds([100, 300]), "recompute": _replica_rounds([50, 900])},
    }
    (row,) = summarize([scenario])
    # one round lost, the other won 3x
    assert row["speedup_p50_per_round"] == pytest.approx([0.5, 3.0])
    assert row["speedup_p50"] == pytest.approx(275 / 175)  # the pooled p50s hide the lost round
    assert "| 1.57x (0.50-3.00) |" in table([row])
    # and the slowest request of each round: the tier's over the recompute's
    assert row["slowest_ratio_per_round"] == pytest.approx([2.0, 1 / 3])
    assert f"| {row['tier_p99_ms']:.0f} / {row['recompute_p99_ms']:.0f} (0.33-2.00) |" in table(
        [row]
    )


def test_tier_and_recompute_go_first_equally_often_in_every_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each level's two rounds run B (tier) before C (recompute) once and after it once, so
    the speedup B/C is not the order's: three replicas rotated one step a round put B first in
    both rounds of every third level."""
    import argparse

    from torch_kv_tier.benchmarks import serve_bench

    class Fake:
        shutdown_s = 0.0

        def __init__(self, log: Path) -> None:
            self.role = log.stem

        def stop(self) -> None:
            pass

        def log_counts(self) -> dict[str, int]:
            return {}

    ran: list[tuple[int, str]] = []

    def run(args: Any, model: str, replica: Fake, concurrency: int, seed: int, p: Any) -> dict:
        ran.append((seed, replica.role))
        return {}

    monkeypatch.setattr(Replica, "start_many", lambda model, specs: [Fake(s[0]) for s in specs])
    monkeypatch.setattr(serve_bench, "_run", run)
    monkeypatch.setattr(serve_bench, "_settle", lambda replica: None)
    args = argparse.Namespace(seed=0, concurrency=[1, 4, 16], repeats=2)
    kv = {"kv_connector_extra_config": {}}
    serve_bench._run_replicas(args, "model", kv, tmp_path / "logs", tmp_path / "prompts")
    seeds = sorted({seed for seed, _ in ran})
    assert len(seeds) == 7  # the warm-up set and 3 levels x 2 rounds
    tier_first = [
        [role for s, role in ran if s == seed and role in ("tier", "recompute")][0] == "tier"
        for seed in seeds[1:]
    ]
    assert [tier_first[i] + tier_first[i + 1] for i in range(0, 6, 2)] == [1, 1, 1]


def test_the_json_load_before_is_read_before_the_replicas_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``conditions.load_before`` is the load average when the run started, not when it ended
    (it was read after every scenario had run); ``load_after`` is the end's."""
    import argparse
    import contextlib

    from torch_kv_tier.benchmarks import serve_bench
    from torch_kv_tier.remote import launch

    ran: list[bool] = []

    @contextlib.contextmanager
    def host(**kwargs: Any) -> Any:
        yield argparse.Namespace(address="127.0.0.1:1")

    def replicas(*args: Any) -> dict[str, Any]:
        ran.append(True)
        return {}

    reported: list[dict[str, Any]] = []
    monkeypatch.setattr(launch.ServerProcess, "start", host)
    monkeypatch.setattr(serve_bench, "_run_replicas", replicas)
    monkeypatch.setattr(serve_bench, "_report", lambda result, out, plot: reported.append(result))
    monkeypatch.setattr(serve_bench.os, "getloadavg", lambda: (9.0,) * 3 if ran else (1.0,) * 3)
    args = argparse.Namespace(
        from_json=None, logs=None, model="model", input_len=64, output_len=4, num_prompts=1,
        concurrency=[1], repeats=1, cpu_mib=["8"], busy=[0], seed=0, out=None, plot=None,
    )  # fmt: skip
    serve_bench.run(args)
    [result] = reported
    assert result["conditions"]["load_before"] == (1.0,) * 3
    assert result["conditions"]["load_after"] == (9.0,) * 3
