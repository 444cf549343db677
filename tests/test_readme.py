"""The README's usage example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_usage_example_runs_as_written() -> None:
    section = README.read_text().split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "README has no python block under ## Usage"
    proc = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stored prefix: 16" in proc.stdout


def test_shared_pool_example_runs_as_written() -> None:
    section = README.read_text().split("### Connect tiers to a shared pool", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "README has no python block under the shared pool heading"
    proc = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded from the other tier: 16" in proc.stdout
