"""``torch-kv-tier fleet-bench`` on a small fleet: every figure lands in the table and the JSON,
through the real host and follower code (a follower that joined holds every key)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torch_kv_tier import cli


def test_tiny_fleet_reports_every_figure_and_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fleet.json"
    argv = ["fleet-bench", "--keys", "3000", "--followers", "1,3", "--hosts", "4,16",
            "--rounds", "2", "--batches", "2", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    figures = result["figures"]
    # a key's 8-byte entry and its slot's 8-byte digest; no Python object per key
    assert 14 <= figures["follower_bytes_per_key"]["median"] <= 18
    assert figures["prefix_lookup_ns"]["p99"] >= figures["prefix_lookup_ns"]["p50"] > 0
    assert set(figures["call_us"]) == {"dict", "compact"}
    assert all(us > 0 for calls in figures["call_us"].values() for us in calls.values())
    assert set(figures["fanout_us_per_key_per_follower"]) == {"1", "3"}
    assert figures["lookup_ns"]["p99"] >= figures["lookup_ns"]["p50"] > 0
    for add, remove in figures["moved_over_1_n_by_hosts"].values():
        assert 0.5 < add < 1.5 and 0.5 < remove < 1.5  # about 1/N move, never all of them
    assert set(result["targets"]) == {
        "follower_bytes_per_key", "join_s_per_million", "fanout_marginal_us", "moved_over_1_n"
    }  # fmt: skip
    assert "targets:" in capsys.readouterr().out


def test_a_fleet_of_one_host_is_refused() -> None:
    assert cli.main(["fleet-bench", "--hosts", "1"]) == 2


@pytest.mark.parametrize(
    "argv",
    [["--keys", "64"], ["--keys", "1"], ["--followers", "1,1"], ["--hosts", "4,4"]],
    ids=["keys-64", "keys-1", "followers-twice", "hosts-twice"],
)
def test_options_it_cannot_measure_are_refused_before_it_runs(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Too few keys for a join of half of them and a 64-key prefix lookup (a traceback once
    the run was over, or at its first join), and a follower or host count named twice (a
    round of two samples), are refused with exit status 2 and the reason, before any figure."""
    from torch_kv_tier.benchmarks import fleet_figures

    def no_figure(*args: object, **kwargs: object) -> int:
        raise AssertionError("a figure was measured")

    monkeypatch.setattr(fleet_figures, "follower_bytes", no_figure)
    assert cli.main(["fleet-bench", "--rounds", "1", "--batches", "1", *argv]) == 2
    assert "fleet-bench: need" in capsys.readouterr().err


def test_percentiles_are_nearest_rank() -> None:
    """p99 of 100 samples is the 99th smallest, not the largest; p50 of 100 is the 50th."""
    from torch_kv_tier.benchmarks.fleet_bench import _pct

    values = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert _pct(values, 99) == 99.0
    assert _pct(values, 50) == 50.0
    assert _pct(values, 100) == 100.0
    assert _pct(values[:10], 99) == 100.0  # 10 samples: p99 is the largest
    assert _pct([7.0], 50) == 7.0


def test_rounds_alternate_the_order_of_what_they_compare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Odd rounds run the fan-out's follower counts and the dict and compact index calls in
    reverse order, so no one of them always runs on the machine the others just warmed (round 0
    is the cold one; measured rounds 1 and 2 reverse, then keep, the order)."""
    from torch_kv_tier.benchmarks import fleet_figures

    order: list[object] = []
    fanout, calls = fleet_figures.fanout_us, fleet_figures.call_us

    def spy_fanout(followers: int, batches: int) -> tuple[float, float]:
        order.append(followers)
        return fanout(followers, batches)

    def spy_calls(n_keys: int, compact: bool, calls_n: int = 2000) -> dict[str, float]:
        order.append("compact" if compact else "dict")
        return calls(n_keys, compact, 20)

    monkeypatch.setattr(fleet_figures, "fanout_us", spy_fanout)
    monkeypatch.setattr(fleet_figures, "call_us", spy_calls)
    argv = ["fleet-bench", "--keys", "2000", "--followers", "1,2", "--hosts", "4",
            "--rounds", "2", "--batches", "1", "--json", str(tmp_path / "f.json")]  # fmt: skip
    assert cli.main(argv) == 0
    fanouts = [x for x in order if isinstance(x, int)]
    forms = [x for x in order if isinstance(x, str)]
    assert fanouts == [1, 2, 2, 1, 1, 2]
    assert forms == ["dict", "compact", "compact", "dict", "dict", "compact"]
    assert set(json.loads((tmp_path / "f.json").read_text())["figures"]["call_us"]) == {
        "dict", "compact"
    }  # fmt: skip


def test_movement_is_judged_at_the_worst_fleet_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Movement ("a host added or removed moves <= 1.2 x 1/N") must hold at every N: one size past
    the bound misses the target, whatever the median over fleet sizes."""
    from torch_kv_tier.benchmarks import fleet_figures

    moved = {4: [1.0, 1.0], 16: [1.5, 1.0], 100: [1.0, 1.0]}
    monkeypatch.setattr(fleet_figures, "moved_over_1_n", lambda hosts, n_keys: moved[hosts])
    out = tmp_path / "fleet.json"
    argv = ["fleet-bench", "--keys", "2000", "--followers", "1", "--hosts", "4,16,100",
            "--rounds", "1", "--batches", "1", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    target = json.loads(out.read_text())["targets"]["moved_over_1_n"]
    assert not target["met"] and target["value"] == 1.5
    assert "MISSED a host added or removed moves" in capsys.readouterr().out


def test_the_cold_round_is_reported_apart_from_the_measured_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first round pays imports and a cold allocator: it runs before the ``--rounds`` measured
    ones and is reported as ``cold``, outside their median and min..max, in the JSON and table."""
    from torch_kv_tier.benchmarks import fleet_figures

    joins = iter([9.0, 1.0, 2.0, 3.0])  # the cold round first
    monkeypatch.setattr(fleet_figures, "join_s", lambda n_keys: next(joins) * n_keys / 1e6)
    out = tmp_path / "fleet.json"
    argv = ["fleet-bench", "--keys", "2000", "--followers", "1", "--hosts", "4",
            "--rounds", "3", "--batches", "1", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    join = json.loads(out.read_text())["figures"]["join_s_per_million"]
    assert join == pytest.approx({"median": 2.0, "min": 1.0, "max": 3.0, "cold": 9.0})
    assert "join per million keys        2.00 (1.00..3.00; cold 9.00) s" in capsys.readouterr().out


def test_index_calls_time_stored_keys_whatever_keys_a_host_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``call_us`` makes 2000 calls of each kind on a host of ``--keys`` keys: with fewer keys
    than calls, every locate still asks 16 stored keys and every contains a stored one (not an
    empty call, nor an IndexError once the run was nearly over)."""
    from torch_kv_tier.benchmarks import fleet_figures
    from torch_kv_tier.index import BlockIndex

    located: list[int] = []
    found: list[bool] = []
    locate, holder = BlockIndex.locate, BlockIndex.holder

    def spy_locate(self: BlockIndex, keys: Any, *args: Any, **kwargs: Any) -> Any:
        located.append(len(keys))
        return locate(self, keys, *args, **kwargs)

    def spy_holder(self: BlockIndex, key: Any) -> Any:
        peer = holder(self, key)
        found.append(peer is not None)
        return peer

    monkeypatch.setattr(BlockIndex, "locate", spy_locate)
    monkeypatch.setattr(BlockIndex, "holder", spy_holder)
    figures = fleet_figures.call_us(100, compact=True, calls=50)
    assert all(us > 0 for us in figures.values())
    assert located == [16] * 50 and found == [True] * 50
