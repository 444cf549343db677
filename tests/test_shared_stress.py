"""Torn-read stress of the shared pool with faults (issues 12 and 17), short: writer and reader
processes share one small pool that evicts all the time, while writers and the host are frozen
with SIGSTOP and resumed; every loaded block is its key's block, reads that raced a rewrite are
rejected by verification ("missing"), and every failure is explained by a freeze.

``torch-kv-tier shared-stress`` runs the long version (4 + 4 processes, 60 s by default).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from torch_kv_tier.benchmarks.shared_stress_faults import Freeze, plan_freezes, unexplained_calls
from torch_kv_tier.benchmarks.shared_stress_worker import (
    Counts,
    block_table,
    check_blocks,
    check_rejected,
)
from torch_kv_tier.cli import main


def _run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = main(["--log-level", "ERROR", "shared-stress", *args, "--json", str(out)])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("copy", ["dict-copy", "compact-copy"])
def test_no_wrong_block_while_writers_evict_and_writers_and_the_host_freeze(
    tmp_path: Path, copy: str
) -> None:
    """2 writers + 2 readers for 40 s; two writer freezes (one past the host's lease timeout)
    and one host freeze past the tiers' heartbeat timeout. Each form of the tiers' copy of the
    host's index (``slot_maps``): the compact one's pending commits, tombstones and merges run
    under the same evictions and freezes."""
    code, report = _run(
        tmp_path,
        *("--writers", "2", "--readers", "2", "--seconds", "40"),
        *("--writer-freezes", "2", "--host-freezes", "1"),
        *(["--compact-index"] if copy == "compact-copy" else []),
    )
    totals, faults = report["totals"], report["faults"]
    assert report["problems"] == [] and code == 0, report["problems"]  # HELD LEAK included
    assert totals["wrong"] == 0
    assert totals["verified"] > 0
    assert totals["other"] == {}  # reads fail only "missing", writes only "capacity"...
    assert totals["unexplained"] == 0  # ... or "peer lost" & co. around a freeze
    assert set(totals["failures"]) <= {"peer lost", "transfer failed", "no peers"}
    assert totals["rejected_wrong"] == totals["rejected"]  # no false rejection
    assert totals["verify_failed"] >= totals["rejected"]
    assert (faults["writers"]["done"], faults["writers"]["long"]) == (2, 1)
    assert (faults["host"]["done"], faults["host"]["long"]) == (1, 1)
    assert totals["peer_waits"] > 0  # the long host freeze dropped the host everywhere
    assert report["server"]["shared_evictions"] > 0  # the pool was too small: reads raced evictions
    # tiers through freezes, resets and redials commit only slots they were granted: the host's
    # warning of a client's bug (``commit_slots_refused``) stays silent on such a run
    assert report["server"]["commit_slots_refused"] == 0
    assert all(isinstance(c["missing"], int) for c in report["processes"])
    assert len(report["processes"]) == 4


def test_the_checker_counts_corrupted_blocks_wrong(tmp_path: Path) -> None:
    """--self-check corrupts two loaded blocks (a flipped bit; another key's valid block): the
    run passes only when exactly those two are counted wrong."""
    code, report = _run(
        tmp_path, "--writers", "1", "--readers", "1", "--seconds", "2", "--self-check"
    )
    assert code == 0, report["problems"]
    assert report["totals"]["injected"] == 2
    assert report["totals"]["wrong"] == 2


def test_check_blocks_tells_wrong_key_and_torn_blocks_from_good_ones() -> None:
    table = block_table(16, 256)
    keys = [3, 4, 5]
    rows = table[keys].copy()
    rows[1, 100] ^= 0x10  # torn: a byte of the payload differs, the CRC no longer matches
    rows[2] = table[6]  # a whole valid block of another key
    counts = Counts("reader", 0)
    check_blocks(table, keys, rows, counts)
    assert (counts.verified, counts.wrong) == (1, 2)
    assert counts.wrong_samples == [
        "key 4: block carries key id 4, CRC BAD",
        "key 5: block carries key id 6, CRC ok",
    ]
    assert not np.array_equal(table[3], table[4])  # blocks depend on the key


def test_check_rejected_counts_missing_rows_that_were_written() -> None:
    table = block_table(16, 256)
    arena = np.zeros((4, 256), dtype=np.uint8)
    arena[0] = table[7]  # landed, another key's block: rejected and wrong
    arena[1] = table[2]  # landed, its own key's block: a false rejection
    # arena[2] stays zero: a key that was not stored, nothing read
    arena[3] = table[9]  # loaded ok: not counted here
    counts = Counts("reader", 0)
    failed = {1: "missing", 2: "missing", 3: "missing"}
    check_rejected(table, failed, [1, 2, 3, 9], [0, 1, 2, 3], arena, counts)
    assert (counts.rejected, counts.rejected_wrong) == (2, 1)


def test_a_failed_call_must_overlap_a_freeze() -> None:
    freeze = Freeze("host", True, 4.0, t_signalled=100.0, t_stopped=100.1, t_resumed=104.0)
    calls = [(99.0, 100.5, "peer lost"), (108.0, 108.1, "peer lost"), (90.0, 95.0, "no peers")]
    assert unexplained_calls(calls, [freeze], slack_s=5.0) == [(90.0, 95.0, "no peers")]
    assert unexplained_calls(calls, [], slack_s=5.0) == calls


def test_every_other_freeze_is_long_and_they_fit_the_window() -> None:
    plan = plan_freezes(random.Random(1), ["writer-0", "writer-1"], 5, 3.0, (4.0, 30.0))
    assert [p.long for p in plan] == [True, False, True, False, True]
    assert all(3.5 <= p.duration_s <= 5.0 for p in plan if p.long)
    assert all(p.duration_s < 3.0 for p in plan if not p.long)
    assert all(4.0 <= p.at <= 30.0 for p in plan) and plan == sorted(plan, key=lambda p: p.at)
