"""Torn-read stress of the shared pool (issue 12), short: writer and reader processes share one
small pool that evicts all the time; every loaded block is its key's block, misses are counted.

``torch-kv-tier shared-stress`` runs the long version (4 + 4 processes, 60 s by default).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from torch_kv_tier.benchmarks.shared_stress_worker import Counts, block_table, check_blocks
from torch_kv_tier.cli import main


def _run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = main(["--log-level", "ERROR", "shared-stress", *args, "--json", str(out)])
    return code, json.loads(out.read_text())


def test_readers_never_load_a_wrong_block_while_writers_keep_evicting(tmp_path: Path) -> None:
    code, report = _run(tmp_path, "--writers", "2", "--readers", "2", "--seconds", "15")
    totals = report["totals"]
    assert report["problems"] == [] and code == 0, report["problems"]
    assert totals["wrong"] == 0
    assert totals["verified"] > 0
    assert totals["other"] == {}  # no "peer lost", "transfer failed", ...
    assert report["server"]["shared_evictions"] > 0  # the pool was too small: reads raced evictions
    assert isinstance(totals["missing"], int)  # reported, whatever the count
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
