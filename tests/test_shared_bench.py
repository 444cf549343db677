"""``torch-kv-tier shared-bench --quick``: every figure of issue 12 lands in the JSON (values
are measured on a noisy machine and not asserted, except what a user relies on: bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torch_kv_tier import cli

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
