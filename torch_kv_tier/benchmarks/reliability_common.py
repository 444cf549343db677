"""Pieces shared by the reliability scenarios: outcomes, figures, UCX over TCP, child processes.

Every scenario returns an ``Outcome``: the figures it measured, each with the limit it is held
to, plus the problems it found (a problem is a broken promise: a hung future, a corrupt block).
``torch-kv-tier stress`` prints outcomes as a table; the tests assert ``outcome.ok``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
import torch

from torch_kv_tier.remote import Region, RemoteSession
from torch_kv_tier.session_ends import END_THREAD
from torch_kv_tier.session_releases import RELEASE_THREAD

# UCX over TCP keeps a write to a stopped peer really in flight; over shared memory (the default
# on one host) it often completes inside transfer(), before any fault can be injected.
TCP_ENV = {"UCX_TLS": "tcp"}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Figure:
    """One measured value and the limit it must meet (``ok``)."""

    name: str
    value: float
    unit: str
    limit: str
    ok: bool

    def text(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.unit == "%":
            return f"{self.value:.2f} %"
        if float(self.value).is_integer() or abs(self.value) >= 100:
            return f"{self.value:,.0f}{unit}"
        return f"{self.value:.3g}{unit}"


@dataclass
class Outcome:
    """What one scenario measured (``figures``) and the promises it saw broken (``problems``)."""

    scenario: str
    params: dict[str, object]
    figures: list[Figure] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and all(f.ok for f in self.figures)

    def figure(self, name: str) -> Figure:
        """The figure called ``name``; ``KeyError`` when the scenario did not measure it."""
        for fig in self.figures:
            if fig.name == name:
                return fig
        raise KeyError(f"{self.scenario} has no figure {name!r}: {[f.name for f in self.figures]}")

    def at_most(self, name: str, value: float, bound: float, unit: str = "") -> None:
        self.figures.append(
            Figure(name, value, unit, f"<= {bound:g} {unit}".rstrip(), value <= bound)
        )

    def at_least(self, name: str, value: float, bound: float, unit: str = "") -> None:
        self.figures.append(
            Figure(name, value, unit, f">= {bound:g} {unit}".rstrip(), value >= bound)
        )

    def equals(self, name: str, value: float, expected: float, unit: str = "") -> None:
        self.figures.append(Figure(name, value, unit, f"== {expected:g}", value == expected))

    def info(self, name: str, value: float, unit: str = "") -> None:
        """A figure reported for context, with no limit."""
        self.figures.append(Figure(name, value, unit, "", True))

    def problem(self, text: str, limit: int = 20) -> None:
        """Record a broken promise; past ``limit`` only the count grows (keeps reports short)."""
        if len(self.problems) < limit:
            self.problems.append(text)
        elif len(self.problems) == limit:
            self.problems.append("... more problems not shown")


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` for what is created inside the block (UCX reads its variables when an agent
    is created; children started inside inherit them); restore the previous values after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ucx_over_tcp() -> contextlib.AbstractContextManager[None]:
    """``UCX_TLS=tcp`` for NIXL agents created inside the block (``environment``)."""
    return environment(TCP_ENV)


def random_blocks(num_blocks: int, block_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block_len), dtype=torch.uint8, generator=g)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` until true (``True``) or ``timeout_s`` passes (``False``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    The signal is delivered asynchronously: right after ``os.kill`` the target (and a progress
    thread of its that wakes on traffic) may still run, and serve what the caller sends next.
    Raises ``TimeoutError`` when a thread is still running after ``timeout_s``.
    """
    os.kill(pid, signal.SIGSTOP)
    if not wait_until(lambda: all_stopped(pid), timeout_s, interval_s=0.001):
        raise TimeoutError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP")


def all_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in state T (stopped), read from ``/proc/PID/task/*/stat``."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:  # "tid (comm) S ...": the state follows the last ')'
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, IndexError):
            continue  # a thread that just exited
    return bool(states) and all(state in "tT" for state in states)


@dataclass(frozen=True)
class Resources:
    """Process resources that a leak would grow."""

    rss: int
    threads: int
    fds: int

    @classmethod
    def of(cls, pid: int | None = None) -> Resources:
        proc = psutil.Process(pid)
        return cls(proc.memory_info().rss, proc.num_threads(), proc.num_fds())


def settled_resources(baseline: Resources, timeout_s: float = 5.0) -> Resources:
    """This process's resources once its thread count is back to ``baseline``'s and no tier
    helper that holds a socket runs (or after ``timeout_s``, with a warning that names the
    threads): a lost session ending, or a release told to a dead host (up to
    ``RELEASE_BUDGET_S``), finish on their own."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = Resources.of()
        helpers = [t for t in threading.enumerate() if t.name in (RELEASE_THREAD, END_THREAD)]
        if now.threads <= baseline.threads and not helpers:
            return now
        if time.monotonic() >= deadline:
            logger.warning(
                "threads not settled after %.1f s: %d against %d before (Python threads: %s)",
                timeout_s,
                now.threads,
                baseline.threads,
                sorted(t.name for t in threading.enumerate()),
            )
            return now
        time.sleep(0.05)


class LineReader:
    """Reads a child's text stream in a daemon thread; ``next_line`` waits with a timeout."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next_line(self, timeout_s: float) -> str | None:
        """The next line; ``None`` at end of stream; ``TimeoutError`` after ``timeout_s``."""
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout_s} s") from None


def kill_process(proc: subprocess.Popen[str]) -> None:
    """SIGKILL (a stopped process dies too) and reap; never raises for a dead one."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def server_stats(address: str, block_len: int) -> dict[str, Any]:
    """The server's stats through a short-lived shared session: it needs no NIXL agent and
    holds no slot (a private lease would need a free one)."""
    session = RemoteSession.open(
        address, agent_metadata=b"stats probe", region=Region(4096, 1, block_len)
    )
    try:
        return session.stats()
    finally:
        session.close()
