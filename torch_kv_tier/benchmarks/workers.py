"""``Workers``: the ``shared_worker`` processes of ``shared-bench`` and ``thread-cost``, and the
one-line JSON commands they answer.

Equal bursts. A point's bursts run every process at once, and a figure is the bytes of all of
them over the span from the first start to the last end, so a process that finishes early
leaves its core idle while the others run on. Each process calibrates its calls per burst from
its own warm-up (``sweep.PointRunner.prepare``: at least ``min_time``), and the processes warm
up side by side, system after system: with 4 processes on 2 cores their counts came out up to
2x apart (bursts of 0.11 s beside bursts of 0.21 s), so a burst ended with one process running
alone, by an amount that differed from system to system and run to run. ``open_point`` gives
every process the same count per system instead: the most any of them calibrated (systems keep
counts of their own, so that each one's bursts last about ``min_time``, and the time lost
between two bursts weighs the same on each).

Threading: one caller; ``ask`` writes to every process, then reads their answers in order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from torch_kv_tier.benchmarks.reliability_common import LineReader, kill_process

ANSWER_TIMEOUT_S = 120.0  # one open (NIXL agents, staging, warm-up) or burst of one process


class Workers:
    """``n`` ``shared_worker`` processes; ``ask`` sends one command to some and collects the
    answers (each within ``ANSWER_TIMEOUT_S``, else ``TimeoutError``)."""

    def __init__(self, n: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.readers: list[LineReader] = []
        try:
            for i in range(n):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "torch_kv_tier.benchmarks.shared_worker", str(i)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                self.procs.append(proc)
                self.readers.append(LineReader(proc.stdout))
        except BaseException:
            self.close()
            raise

    def ask(self, n: int, msg: dict[str, Any], first: int = 0) -> list[dict[str, Any]]:
        """Send ``msg`` to workers ``first .. n - 1``; their answers, in order. Raises
        ``RuntimeError`` naming each worker that failed the command or exited."""
        line = json.dumps(msg) + "\n"
        for proc in self.procs[first:n]:
            assert proc.stdin is not None
            proc.stdin.write(line)
            proc.stdin.flush()
        answers = []
        for i, reader in enumerate(self.readers[first:n], start=first):
            text = reader.next_line(ANSWER_TIMEOUT_S)
            if text is None:
                raise RuntimeError(f"worker {i} exited (code {self.procs[i].poll()})")
            answers.append(json.loads(text))
        errors = [
            f"worker {i}: {a['error']}" for i, a in enumerate(answers, start=first) if not a["ok"]
        ]
        if errors:
            raise RuntimeError("; ".join(errors))
        return answers

    def open_point(self, n: int, msg: dict[str, Any]) -> dict[str, int]:
        """Open a point (``msg``: an ``open`` command) in workers ``0 .. n - 1`` and give them
        all the same calls per burst of each system (module docstring); returns those counts."""
        answers = self.ask(n, msg)
        calls = {name: max(a["calls"][name] for a in answers) for name in answers[0]["calls"]}
        self.ask(n, {"cmd": "calls", "calls": calls})
        return calls

    def close(self) -> None:
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                proc.stdin.write('{"cmd": "exit"}\n')
                proc.stdin.flush()
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                kill_process(proc)
