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


def _commands(text: str) -> set[str]:
    """Every shell command in ``text``'s code (blocks and inline), split at ``&&``, with
    continuation lines joined and whitespace collapsed."""
    code = re.findall(r"```(?:bash)?\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    commands = set()
    for chunk in code:
        for line in chunk.replace("\\\n", " ").splitlines():
            for command in line.split("&&"):
                commands.add(" ".join(command.strip(" ()").split()))
    return commands


def test_the_quick_start_states_every_setup_and_test_command_ci_runs() -> None:
    """A user following the README sets up and tests as ``.ci/run`` does (its ``-q`` aside)."""
    ci = (README.parent / ".ci" / "run").read_text().replace("\\\n", " ")
    wanted = set()
    for line in ci.splitlines():
        for command in line.split("&&"):
            command = " ".join(command.strip(" ()").split())
            command = re.sub(r"\bpip install -q ", "pip install ", command)
            if command.endswith("&"):  # a head start on what a later stage's script does too
                continue
            if re.match(r"(python3? -m|pip |\. |ruff |mypy |\.ci/)", command):
                wanted.add(command)
    assert "python -m pytest -q" in wanted, "the parse of .ci/run found no test command"
    quick_start = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    missing = sorted(wanted - _commands(quick_start))
    assert not missing, f"README's quick start lacks what .ci/run runs: {missing}"
