"""The README's examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("## Usage", "stored prefix: 16"),
        ("### Connect tiers to a shared pool", "loaded from the other tier: 16"),
    ],
)
def test_example_runs_as_written(heading: str, expected: str) -> None:
    section = README.read_text().split(heading, 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, f"README has no python block under {heading!r}"
    proc = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout
