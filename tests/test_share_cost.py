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


def test_the_two_followers_take_turns_going_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round by round the dict and the compact copy apply the events in alternating order, so
    neither always runs on caches the other just warmed."""
    import time
    from types import SimpleNamespace

    from torch_kv_tier.benchmarks import share_cost
    from torch_kv_tier.index import BlockIndex

    log: list[str] = []  # "clock" at every CPU-time reading, the copy at every apply

    class Spy(BlockIndex):
        def apply_host_changes(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            log.append("compact" if self.compact else "dict")
            return super().apply_host_changes(*args, **kwargs)

    def thread_time() -> float:
        log.append("clock")
        return time.thread_time()

    monkeypatch.setattr(share_cost, "BlockIndex", Spy)
    monkeypatch.setattr(share_cost, "time", SimpleNamespace(thread_time=thread_time))
    cfg = {**share_cost.DEFAULTS, "tiers": [1], "pool_slots": 1024, "keys_per_commit": 64,
           "rounds": 3, "steps": 2}  # fmt: skip
    [row] = share_cost.measure(cfg)
    assert all(len(v) == 3 for v in row["rounds_us_per_key"].values())
    clocks = [i for i, x in enumerate(log) if x == "clock"]
    timed = [log[a + 1] for a, b in zip(clocks, clocks[1:]) if b > a + 1]  # applies between
    assert timed[-6:] == ["dict", "compact", "compact", "dict", "dict", "compact"]  # 3 rounds
