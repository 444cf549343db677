"""``torch-kv-tier share-cost`` on a small pool: every cell is measured, in the table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torch_kv_tier import cli


def test_tiny_run_measures_every_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "share.json"
    argv = ["share-cost", "--tiers", "1,2", "--pool-slots", "1024", "--keys-per-commit", "64",
            "--rounds", "2", "--steps", "5", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tiers"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r["us_per_key"]) == {"commit", "grant", "events", "dict", "compact"}
        assert all(len(v) == 2 and min(v) > 0 for v in r["rounds_us_per_key"].values())
        # the pool is full: every key stored evicts one, and both changes are announced
        assert r["announced_per_stored"] == pytest.approx(2.0)
        assert set(r["ms_per_gb"]) == {str(64 << 10), str(256 << 10)}
    assert "| 2 | 64K |" in capsys.readouterr().out


def test_a_commit_larger_than_half_the_pool_is_refused() -> None:
    assert cli.main(["share-cost", "--pool-slots", "100", "--keys-per-commit", "64"]) == 2
