"""The benchmarks' conditions are measured fairly: each benchmark alternates which condition,
system or request runs first, and pairs its figures (medians of per-round ratios or paired
differences), with a cold first pass left out."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_support import FakePollTransport

from torch_kv_tier.benchmarks import engine_ttft, report_summary


def test_poll_scaling_alternates_the_order_of_its_depths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round runs each depth once, the order reversed every other round, so a change of
    load over the measurement does not fall on the deepest runs alone; each timed run's blocks
    are read back right after it (with its own pattern, as the depths write the same slots)."""
    from torch_kv_tier.benchmarks import poll_scaling

    order: list[tuple[int, int]] = []
    steady, read_back = poll_scaling._Steady, poll_scaling._read_back

    def run(transport: Any, depth: int, slots: int, base: int, total: int) -> Any:
        order.append((depth, total))
        return steady(transport, depth, slots, base, total)

    def check(*args: Any) -> int:
        order.append((0, 0))
        return read_back(*args)

    monkeypatch.setattr(poll_scaling, "_Steady", run)
    monkeypatch.setattr(poll_scaling, "_read_back", check)
    slots = 100
    arena = torch.zeros(2 * slots, 64, dtype=torch.uint8)
    transport = FakePollTransport(arena, slots, corrupt=-1)
    rows = poll_scaling._rounds(transport, arena, [10, 20, 30], slots, 0, 7)
    assert order[:3] == [(30, 500), (20, 500), (10, 500)]  # the warm-up, excluded
    timed = order[3:]
    assert timed[1::2] == [(0, 0)] * 9  # a read-back after every timed run
    assert [depth for depth, _ in timed[::2]] == [10, 20, 30, 30, 20, 10, 10, 20, 30]
    assert all(r["verified"] for r in rows)


def test_poll_growth_is_the_median_of_per_round_ratios() -> None:
    """The 'flat from 10 to 10,000' target pairs the two depths' runs of each round, as the
    other ratios do: not the ratio of two medians taken from different rounds (2.25 here, a
    miss, where no round's ratio is above 2.5 and two of three are 1.5)."""
    base = {"kind": "poll_scaling", "transport": "shm", "verified": True}
    rows = [
        {**base, "inflight": 10, "poll_us_per_transfer": 2.0, "poll_us_per_round": [1, 2, 3]},
        {**base, "inflight": 1000, "poll_us_per_transfer": 4.5, "poll_us_per_round": [1.5, 5, 4.5]},
    ]
    [line] = [t for t in report_summary.targets(rows) if "poll cost" in t]
    assert "(x1.50 [1.50-2.50], median of per-round ratios" in line and line.endswith(": met")


def test_promotion_trace_splits_a_request_into_segments_that_add_up() -> None:
    from torch_kv_tier.benchmarks.promotion_trace import SEGMENTS, _Timeline, segments

    timeline = _Timeline()
    names = ["generate>"]
    names += ["schedule>", "read>", "read<", "schedule<", "update>", "update<"]
    names += ["schedule>", "schedule<", "update>", "update<"] * 2
    names += ["generate<"]
    timeline.events = [(i * 1e-3, name) for i, name in enumerate(names)]  # 1 ms apart
    timeline.lookup_s, timeline.finished_jobs_s = 0.5e-3, 0.25e-3
    seg = segments(timeline)
    assert seg["total"] == pytest.approx(len(names) - 1)
    assert sum(seg[name] for name in SEGMENTS) == pytest.approx(seg["total"])
    assert seg["tier_read"] == pytest.approx(1) and seg["vllm_lookup"] == pytest.approx(0.5)
    assert seg["step1_rest"] == pytest.approx(3) and seg["step2"] == pytest.approx(3)
    assert seg["step3_forward"] == pytest.approx(1) and seg["tier_work"] == pytest.approx(1.75)
    del timeline.events[1:7]  # no promotion step: a recompute's trace
    with pytest.raises(ValueError, match="not a three-step promotion"):
        segments(timeline)


def test_promotion_trace_alternates_which_request_runs_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Odd repeats time the recompute before the promoted request (neither always runs on the
    engine the other just warmed), each after the settling steps and a reset of vLLM's caches."""
    import contextlib

    from torch_kv_tier.benchmarks import promotion_trace

    log: list[Any] = []
    seen: set[tuple[int, ...]] = set()

    class Engine:
        def reset_prefix_cache(self, reset_connector: bool) -> None:
            log.append(("reset", reset_connector))

    def ttft(llm: object, prompt: list[int]) -> tuple[float, int]:
        log.append(prompt)
        cached = 16 if tuple(prompt[:16]) in seen else 0  # its prefix offloaded before
        seen.add(tuple(prompt[:16]))
        return float(len(log)), cached

    monkeypatch.setattr(promotion_trace, "_ttft", ttft)
    monkeypatch.setattr(promotion_trace, "_instrumented", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(promotion_trace.time, "sleep", lambda s: None)
    rows = promotion_trace.measure(Engine(), prefix_tokens=16, repeats=4, seed=0)
    size = 16 + promotion_trace.SUFFIX_TOKENS  # the offload, the promoted and the recompute
    at = [i for i, entry in enumerate(log) if isinstance(entry, list) and len(entry) == size]
    assert len(at) == 3 * 5  # repeats -1 (the warm-up) to 3
    firsts = []
    for k in range(5):
        offload, first, second = (log[i] for i in at[3 * k : 3 * k + 3])
        firsts.append(first[:16] == offload[:16])
        assert (second[:16] == offload[:16]) != firsts[-1]
    assert firsts == [False, True, False, True, False]
    for i in (i for n, i in enumerate(at) if n % 3):  # both timed requests settle, then reset
        assert log[i - 1] == ("reset", True) and len(log[i - 2]) == 40
    assert [r["repeat"] for r in rows] == [0, 1, 2, 3]
    assert all(r["cached"] == 16 and "recompute" in r for r in rows)


def test_engine_ttft_alternates_which_condition_runs_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Odd repeats run ``recompute`` before ``remote`` (neither always gets the warmer engine),
    and each still starts from a reset of the device cache and the connector's tiers."""
    log: list[tuple[str, Any]] = []

    class Engine:
        def reset_prefix_cache(self, reset_connector: bool) -> None:
            log.append(("reset", reset_connector))

    def ttft(llm: object, prompt: list[int]) -> tuple[float, int]:
        log.append(("ttft", prompt))
        return float(len(log)), len(prompt)  # the "seconds" say when it ran

    monkeypatch.setattr(engine_ttft, "_ttft", ttft)
    rows = engine_ttft.measure(Engine(), prefix_tokens=16, repeats=4, seed=0)
    at = {(r["repeat"], r["condition"]): r["ttft_s"] for r in rows}
    firsts = [at[(k, "remote")] < at[(k, "recompute")] for k in range(4)]
    assert firsts == [True, False, True, False]
    for k in range(4):  # every sample comes after a reset of the tiers it must not hit
        for condition, connector in (("remote", True), ("recompute", True), ("cpu_tier", False)):
            assert log[int(at[(k, condition)]) - 2] == ("reset", connector)


def test_call_cost_alternates_which_system_bursts_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Odd rounds time the bare NIXL burst before the tier's, so neither always runs right
    after the other warmed the caches and the host."""
    from torch_kv_tier.benchmarks import call_cost

    order: list[tuple[str, str]] = []
    tier_burst, raw_burst = call_cost._tier_burst, call_cost._raw_burst

    def tier(t: Any, op: str, keys: list[list[Any]], local: list[int]) -> float:
        order.append(("tier", op))
        return tier_burst(t, op, keys, local)

    def raw(r: Any, op: str, local: list[int], remotes: list[list[int]]) -> float:
        order.append(("raw", op))
        return raw_burst(r, op, local, remotes)

    monkeypatch.setattr(call_cost, "_tier_burst", tier)
    monkeypatch.setattr(call_cost, "_raw_burst", raw)
    assert call_cost.main(["--calls", "4", "--rounds", "2", "--batch", "2"]) == 0
    reads = [name for name, op in order if op == "read"]
    assert reads == ["tier", "raw", "raw", "tier", "tier", "raw"]  # rounds 0 (warm-up), 1, 2
    assert "tier/raw median" in capsys.readouterr().out


def test_passive_progress_alternates_the_initiator_it_times_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write rates with and without the initiator's progress thread swap places every
    round, so neither always runs on the target the other just woke."""
    from torch_kv_tier.benchmarks import passive_progress

    order: list[bool] = []

    def rate(metadata: bytes, base_addr: int, passive: bool, seconds: float = 1.0) -> float:
        order.append(passive)
        return 1.0

    monkeypatch.setattr(passive_progress, "_write_rate", rate)
    row = passive_progress.measure(None, 0, idle_s=0.05, tries=3, gap_s=0.001)
    assert order == [True, False, False, True, True, False]
    assert row["initiator_writes_per_s_with_thread"] == 1.0


def test_passive_progress_alternates_which_delay_it_measures_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Our progress delay and NIXL's 0 (the reference) take turns going first, transport by
    transport, so the reference does not always run on the machine ours just left; the table
    keeps ours first."""
    from torch_kv_tier.benchmarks import passive_progress
    from torch_kv_tier.transport.nixl_agent import PROGRESS_DELAY_US

    order: list[tuple[str | None, int]] = []

    def measure(tls: str | None, delay_us: int, *args: Any) -> dict[str, Any]:
        order.append((tls, delay_us))
        return {"ucx_tls": tls or "default", "progress_delay_us": delay_us,
                "idle_cpu_no_peer": 0.0, "idle_cpu_one_peer": 0.0, "latency_ms_median": 0.0,
                "latency_ms_p90": 0.0, "initiator_writes_per_s_with_thread": 1.0,
                "initiator_writes_per_s_without_thread": 1.0}  # fmt: skip

    monkeypatch.setattr(passive_progress, "measure", measure)
    assert passive_progress.main([]) == 0
    assert order == [("tcp", PROGRESS_DELAY_US), ("tcp", 0), (None, 0), (None, PROGRESS_DELAY_US)]
    table = [line.split(" | ")[:2] for line in capsys.readouterr().out.splitlines()[2:]]
    ours = f"{PROGRESS_DELAY_US / 1e3:g} ms"
    assert table == [["| tcp", ours], ["| tcp", "0 ms"], ["| default", ours], ["| default", "0 ms"]]


def test_vllm_cpu_copy_alternates_its_copies_and_pairs_each_jobs_ratio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every other job runs memcpy first and the worker's store last; each job's worker/memcpy
    ratio is kept, its median and min..max reported beside the ratio of medians."""
    pytest.importorskip("vllm")
    import ctypes

    from torch_kv_tier.benchmarks import vllm_cpu_copy
    from torch_kv_tier.integrations.vllm.cpu_worker import CPUKVCopyWorker

    order: list[str] = []
    for name in ("submit_store", "submit_load"):
        real = getattr(CPUKVCopyWorker, name)

        def spy(self: Any, *args: Any, _real: Any = real, _name: str = name) -> Any:
            order.append(_name[len("submit_") :])
            return _real(self, *args)

        monkeypatch.setattr(CPUKVCopyWorker, name, spy)
    memmove = ctypes.memmove
    monkeypatch.setattr(ctypes, "memmove", lambda *a: (order.append("memcpy"), memmove(*a))[1])
    result = vllm_cpu_copy._bench_shape(2, 16384, 4, 3)
    assert order[:6] == ["store", "load", "memcpy", "memcpy", "load", "store"]
    for op in ("store", "load"):
        per_job = result[f"{op}_over_memcpy_per_job"]
        assert 0 < per_job["min"] <= per_job["median"] <= per_job["max"]


def test_disk_bench_leaves_the_first_cold_pass_out_of_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier path's first pass (NIXL's POSIX backend and the files' first touch) runs before
    the timed rounds: no round's figure, and no ratio's min, is a cold start's."""
    from torch_kv_tier.benchmarks import disk_bench

    passes: list[str] = []

    def ours(store: Any, kind: str, blocks: int, rnd: int) -> float:
        passes.append(kind)
        return 100.0 if len(passes) == 1 else 1.0  # the first write is 100 x slower

    monkeypatch.setattr(disk_bench, "_ours", ours)
    monkeypatch.setattr(disk_bench, "_raw", lambda fd, pool, kind, chunk: 1.0)
    result = disk_bench.throughput(tmp_path, 64 << 10, 1 << 20, rounds=2)
    for op in ("write", "read"):
        assert len(result[op]["ours_rounds"]) == 2
        assert result[op]["ratio_min"] == result[op]["ratio_max"] == 1.0


def test_disk_capacity_counts_only_the_timed_requests_promotions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's ``disk_promotions`` is what its timed requests promoted, beside their hit
    rate: the warm-up's promotions (its second pass loads every prefix) are left out."""
    import contextlib

    from torch_kv_tier.benchmarks import disk_capacity
    from torch_kv_tier.manager import TierManager

    promoted = iter(range(1000, 100000, 1000))  # the host's counter, read after each phase
    phases: list[str] = []

    @contextlib.contextmanager
    def serve(pool_blocks: int, block_len: int, disk: Any, disk_bytes: int) -> Any:
        yield argparse.Namespace(address="127.0.0.1:1")

    def requests(tier: Any, prefixes: int, sequence: list[int], data: Any) -> dict[str, int]:
        phases.append("warm-up" if len(sequence) == 2 * prefixes else "timed")
        return {"hits": len(sequence), "misses": 0, "wrong": 0, "blocks_loaded": 0}

    monkeypatch.setattr(disk_capacity, "_serve", serve)
    monkeypatch.setattr(disk_capacity, "_serve_requests", requests)
    monkeypatch.setattr(
        disk_capacity, "server_stats", lambda address, bl: {"disk_promotions": next(promoted)}
    )
    monkeypatch.setattr(TierManager, "connect", lambda self, address: "peer")
    monkeypatch.setattr(TierManager, "peers", lambda self: ["peer"])
    monkeypatch.setattr(TierManager, "remove_peer", lambda self, peer: None)
    monkeypatch.chdir(tmp_path)  # its work directory goes under the current one
    result = disk_capacity.capacity(
        pool_mib=1, disk_mib=4, block_len=64 << 10, rounds=1, requests=5, seed=0
    )
    assert phases == ["warm-up", "timed"] * 2
    assert [r["disk_promotions"] for r in result["rounds"]] == [1000, 1000]


def test_disk_restart_alternates_its_starts_and_pairs_their_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The starts with and without the disk take turns going first, round by round, and the
    recovery cost is the median of each round's difference: one start each, the bare one
    always first, measured the load's drift as well (here every start is 0.5 s slower than
    the one before)."""
    import contextlib

    from torch_kv_tier.benchmarks import disk_capacity
    from torch_kv_tier.manager import TierManager

    clock = [0.0]
    starts: list[tuple[bool, int]] = []

    @contextlib.contextmanager
    def serve(pool_blocks: int, block_len: int, disk: Any, disk_bytes: int, admit: int = 2) -> Any:
        starts.append((disk is not None, admit))
        clock[0] += (5.0 if disk is not None else 1.0) + 0.5 * (len(starts) - 1)
        yield argparse.Namespace(address="127.0.0.1:1", kill=lambda: None)

    monkeypatch.setattr(disk_capacity, "_serve", serve)
    fake_time = argparse.Namespace(perf_counter=lambda: clock[0], sleep=lambda s: None)
    monkeypatch.setattr(disk_capacity, "time", fake_time)
    monkeypatch.setattr(disk_capacity, "server_stats", lambda address, bl: {"disk_keys": 1000})
    monkeypatch.setattr(TierManager, "connect", lambda self, address: "peer")
    monkeypatch.setattr(TierManager, "store", lambda self, keys, blocks: None)
    result = disk_capacity.restart(tmp_path, pool_mib=1, disk_mib=4, block_len=64 << 10)
    timed = [with_disk for with_disk, _ in starts[:6]]  # 3 rounds
    assert timed == [False, True, True, False, False, True]
    assert starts[-2:] == [(True, 1), (True, 2)]  # the burst cut by SIGKILL, then its recovery
    assert result["ready_rounds"] == [[5.5, 1.0], [6.0, 2.5], [7.5, 3.0]]
    assert result["recovery_s_per_million_keys"] == pytest.approx(4.5 / 1000 * 1e6)


def test_call_cost_adds_the_median_of_paired_differences(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the tier adds per call is the median of each round's tier - raw, the two bursts of
    a round paired, as the ratio beside it is: not the difference of two medians taken over
    different rounds (18 µs here, where no round's difference is above 9 but one of 28)."""
    from torch_kv_tier.benchmarks import call_cost

    # round 0 warms up; the reads first store what they read (the 1)
    tier_us, raw_us = iter([5, 10, 20, 30, 1, 5, 10, 20, 30]), iter([5, 1, 19, 2] * 2)
    monkeypatch.setattr(call_cost, "_tier_burst", lambda *a: next(tier_us) * 1e-6)
    monkeypatch.setattr(call_cost, "_raw_burst", lambda *a: next(raw_us) * 1e-6)
    assert call_cost.main(["--calls", "1", "--rounds", "3", "--batch", "2"]) == 0
    write = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("write"))
    assert write.split()[1:5] == ["20.0", "2.0", "9.0", "4.50"]
