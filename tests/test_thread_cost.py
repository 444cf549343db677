"""``torch-kv-tier thread-cost`` with one tier process: every thread kind it names is read from
/proc, and a shared tier has a session I/O thread that wakes, a private one none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from torch_kv_tier import cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_one_tier_run_reads_every_thread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "threads.json"
    argv = ["thread-cost", "--tiers", "1", "--seconds", "1", "--rounds", "1",
            "--working-set-mib", "2", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"shared", "private"}
    for row in rows.values():
        [window] = row["windows"]
        assert window["gbps"] > 0 and window["per_gb"]["tier"]["cpu_ms"] > 0
    shared, private = (rows[s]["windows"][0]["per_gb"] for s in ("shared", "private"))
    # its I/O thread wakes for commits, grants and events; a private lease's only heartbeats
    assert shared["session"]["voluntary"] > max(5 * private["session"]["voluntary"], 0)
    assert shared["host"]["cpu_ms"] > 0  # the shared host answers it
    assert "| 64K | shared |" in capsys.readouterr().out


def test_a_window_of_no_time_is_refused() -> None:
    # as the command line is parsed (options.duration): argparse exits 2
    with pytest.raises(SystemExit) as exited:
        cli.main(["thread-cost", "--seconds", "0"])
    assert exited.value.code == 2


def test_each_system_reads_the_threads_of_its_own_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The private rows' ``host`` kinds are the private host's threads, not the idle shared
    host's: each window samples the host its system moves bytes to."""
    from torch_kv_tier.benchmarks import shared_bench, thread_cost

    shared, _ = shared_bench.shared_pool(64 << 10, 2, 1)
    pools = {"shared": shared, "private": 2 * shared}
    read: list[tuple[str, list[int]]] = []
    real = thread_cost._window

    def window(workers, n, system, seconds, procs):  # type: ignore[no-untyped-def]
        for pid in (pid for pid, _, host in procs if host):
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            read.append((system, [int(argv[argv.index("--num-blocks") + 1])]))
        return real(workers, n, system, seconds, procs)

    monkeypatch.setattr(thread_cost, "_window", window)
    argv = ["thread-cost", "--tiers", "1", "--seconds", "0.5", "--rounds", "1",
            "--working-set-mib", "2", "--json", str(tmp_path / "t.json")]  # fmt: skip
    assert cli.main(argv) == 0
    assert sorted(read) == sorted((system, [pool]) for system, pool in pools.items())
