"""``torch-kv-tier shared-bench --quick``: every figure of issue 12 lands in the JSON (values
are measured on a noisy machine and not asserted, except what a user relies on: bytes); and the
worker's keys and byte check, on hosts that outlive its points."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torch_kv_tier import cli
from torch_kv_tier.benchmarks.remote import host_group
from torch_kv_tier.benchmarks.shared_bench import private_lease
from torch_kv_tier.benchmarks.shared_worker import Worker
from torch_kv_tier.benchmarks.workers import Workers

BLOCK_LEN = 4096

THROUGHPUT_FIELDS = {
    "op",
    "block_len",
    "tiers",
    "hosts",
    "gbps",
    "gbps_rounds",
    "ratios",
    "verified",
}
SPREAD = {"median", "q1", "q3", "min", "max"}


def test_too_few_hit_blocks_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["shared-bench", "--quick", "--hit-blocks", "10"]) == 2
    assert "--hit-blocks must be >= 16" in capsys.readouterr().err


def test_quick_run_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shared.json"
    assert cli.main(["shared-bench", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())

    points = result["throughput"]
    shapes = {(p["tiers"], p["hosts"]) for p in points}
    assert {(1, 1), (2, 1), (1, 2)} <= shapes  # tiers sharing a host, and hosts under a tier
    for p in points:
        assert p.keys() >= THROUGHPUT_FIELDS
        assert p["op"] in ("store", "load")
        assert p["verified"], p  # every system moved the right bytes
        for system in ("nixl_raw", "shared", "private"):
            assert p["gbps"][system].keys() >= SPREAD
            assert len(p["gbps_rounds"][system]) == result["config"]["rounds"]
        for ratio in ("shared/nixl_raw", "private/nixl_raw", "shared/private"):
            assert p["ratios"][ratio].keys() >= SPREAD
    assert {p["op"] for p in points} == {"store", "load"}

    hit = result["cross_tier_hit"]
    assert hit["blocks"] == 1000 and hit["identical_blocks"] == 1000

    for name in ("lookup_hit_32", "lookup_miss_32", "contains"):
        assert result["lookup"][name].keys() >= {"p50_us", "p99_us"}
    assert result["load_latency"].keys() >= {"keys_per_call", "p50_us", "p99_us"}
    assert result["staleness"].keys() >= {"p50_us", "p99_us", "unseen_after_5s"}

    kill = result["host_kill"]
    assert kill["hung_futures"] == 0 and kill["wrong_bytes_blocks"] == 0
    first = kill["first_load"]
    assert first["ok"] + first["missing"] + first["peer lost"] + first["other"] == kill["keys"]
    assert kill["reload"]["ok"] == kill["keys"] - kill["keys_on_killed_host"]
    assert "settle_s" in kill

    assert result["env"].keys() >= {"loadavg_start", "loadavg_end", "cpus", "command"}
    table = capsys.readouterr().out
    assert "shared/private" in table and "cross-tier hit" in table


@pytest.fixture
def hosts() -> Iterator[tuple[str, str]]:
    """A shared host and a private one, large enough that no test evicts a key."""
    with host_group(None, BLOCK_LEN, [8192, 8192], ["--max-grant", "512"]) as group:
        assert all(h.address is not None for h in group), [h.problem for h in group]
        yield str(group[0].address), str(group[1].address)


def _open(hosts: tuple[str, str], op: str) -> dict[str, Any]:
    """A small ``open`` of both tier systems: 16 blocks cycled, repeats of ~10 ms."""
    return {"cmd": "open", "block_len": BLOCK_LEN, "addresses": [hosts[0]],
            "private_addresses": [hosts[1]], "systems": ["shared", "private"],
            "working_set": 16 * BLOCK_LEN, "batch": 4, "inflight": 2, "op": op,
            "min_time": 0.01, "warmup": 0.005, "seed": 1, "private_lease": 64}  # fmt: skip


def test_points_never_store_a_key_twice(hosts: tuple[str, str]) -> None:
    """Each point opens fresh tiers over the same hosts; the third stores again after the
    first. A runner restarting its keys per point re-stored the first point's keys: the shared
    host kept their first bytes, the stores sent nothing, the read-back found the old bytes."""
    worker = Worker(0)
    try:
        marks = []
        for op in ("write", "read", "write"):
            marks.append(worker.keys.next)
            worker.open(_open(hosts, op))
            for name in ("shared", "private"):
                assert worker.burst({"system": name})["bytes"] > 0
            worker.last({})
            assert worker.finish({})["verified"] == {"shared": True, "private": True}
        assert marks == sorted(set(marks))  # every point began past the keys of the last
    finally:
        worker.close()


def test_every_process_runs_the_same_calls_per_burst(hosts: tuple[str, str]) -> None:
    """A burst's figure spans all processes from the first start to the last end: one that
    calibrated fewer calls finished early and left its core idle. ``open_point`` gives every
    process the most calls any of them calibrated, per system, in whole cycles of its plan."""
    workers = Workers(2)
    try:
        calls = workers.open_point(2, _open(hosts, "write"))
        cycle = 16 // 4  # calls over the working set: 16 blocks, 4 a call
        assert calls.keys() == {"shared", "private"}
        for name, count in calls.items():
            assert count >= cycle and count % cycle == 0
            answers = workers.ask(2, {"cmd": "burst", "system": name})
            assert [a["bytes"] for a in answers] == [count * 4 * BLOCK_LEN] * 2
    finally:
        workers.close()


@pytest.mark.parametrize("system", ["shared", "private"])
def test_burst_whose_stores_send_nothing_fails(hosts: tuple[str, str], system: str) -> None:
    """A repeat re-storing the keys of the one before sends nothing: its bytes are no figure.

    The working set (which sizes a private tier's lease) holds far more than one repeat
    stores: with a lease smaller than a repeat, LRU eviction made every re-store send its bytes
    again (the check then rightly saw nothing to complain about, on a machine fast enough)."""
    worker = Worker(0)
    try:
        worker.open({**_open(hosts, "write"), "systems": [system], "working_set": 1024 * BLOCK_LEN})
        mark = worker.keys.next
        worker.burst({"system": system})
        state = worker.states[system]
        assert state.calls * state.point.batch <= 1024  # it fits the lease: nothing was evicted
        worker.keys.next = mark  # as a key counter restarting would
        with pytest.raises(RuntimeError, match=f"{system} store repeat claims .* moved 0 B"):
            worker.burst({"system": system})
    finally:
        worker.close()


@pytest.mark.parametrize(("tiers", "n_hosts"), [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4)])
def test_a_private_tier_leases_as_much_as_a_shared_one_cycles_through(
    tiers: int, n_hosts: int
) -> None:
    """A lease of the working set alone stays in the CPU's caches where a shared pool does not:
    the private tiers together lease one pool per host (``system_tier`` leases 1.5 x an even
    share of its lease on each of several hosts)."""
    lease = private_lease(6144, tiers, n_hosts)
    per_host = lease * tiers if n_hosts == 1 else -(-3 * lease // (2 * n_hosts))
    assert per_host == 6144
