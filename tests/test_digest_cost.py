"""``torch-kv-tier digest-cost`` on small sizes: every cell lands in the table and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torch_kv_tier import cli


def test_tiny_run_writes_every_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "digest.json"
    argv = ["digest-cost", "--block-sizes", "16K,64K", "--arena-mib", "4", "--rounds", "2",
            "--min-time", "0.005", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["block_len"], r["place"], r["function"]) for r in rows}
    assert cells == {
        (bl, place, fn) for bl in (16 << 10, 64 << 10)
        for place in ("cache", "dram", "busy") for fn in ("digest", "xxh3")
    }  # fmt: skip
    for r in rows:
        assert len(r["gbps_per_core_rounds"]) == 2 and r["gbps_per_core"]["median"] > 0
    assert "| 64K | busy |" in capsys.readouterr().out


def test_an_arena_smaller_than_one_call_is_refused() -> None:
    assert cli.main(["digest-cost", "--block-sizes", "2M", "--arena-mib", "1"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_device_without_cuda_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["digest-cost", "--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err
    assert cli.main(["digest-cost", "--device", "tpu"]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_digest_cost_times_both_digests_and_both_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "digest.json"
    argv = ["digest-cost", "--device", "cuda", "--block-sizes", "16K,64K", "--arena-mib", "4",
            "--rounds", "2", "--min-time", "0.005", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["block_len"], r["function"]) for r in rows} == {
        (bl, fn)
        for bl in (16 << 10, 64 << 10)
        for fn in ("digest", "digest_pageable", "d2h", "d2h_pinned")
    }
    assert all(len(r["gbps_wall_rounds"]) == 2 and r["gbps_wall"]["median"] > 0 for r in rows)
    assert "| 64K |" in capsys.readouterr().out
