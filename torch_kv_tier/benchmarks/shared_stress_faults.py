"""Faults of ``torch-kv-tier shared-stress`` (``shared_stress``): the host and the writer
processes frozen with SIGSTOP and resumed with SIGCONT at random times during the run.

``plan_freezes`` draws the schedule up front (a pure function of the seed): ``count`` freezes
of a kind at random times in the run's window, every other one (the first included) *long*,
i.e. longer than the timeout that matters for that kind, the others *short* (under it):

- a writer frozen longer than the host's ``--lease-timeout`` has its session ended by the host
  (its grants held until it releases them); once resumed, its tier finds the session gone,
  drops the host and dials it again;
- the host frozen longer than the tiers' heartbeat timeout is dropped by every tier, which then
  dials it again (and, once resumed past its own lease timeout, the host ends every session).

``Freezer`` runs one schedule on a daemon thread: it sends SIGSTOP, waits until every thread
of the target is stopped (``reliability_common.stop_process``: state ``T`` in
``/proc/PID/task/*/stat``) and only then counts the freeze and starts its clock; it sends
SIGCONT after the duration. ``stop`` resumes whatever it froze, whatever happened: no process
is left stopped. Each freeze is recorded as a ``Freeze`` (``time.monotonic`` spans: the same
clock in every process, so the parent can match a worker's failed calls with them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from torch_kv_tier.benchmarks.reliability_common import stop_process

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # every thread of a SIGSTOPped process in state T
FREEZE_EXTRA_S = 2.0  # a long freeze lasts its timeout plus 0.5 to this much
SHORT_FRACTION = (0.1, 0.6)  # a short freeze lasts this fraction of its timeout


@dataclass(frozen=True)
class Planned:
    """One freeze to do: ``target`` at ``at`` s into the run, for ``duration_s``."""

    target: str  # "host" or "writer-I"
    at: float
    duration_s: float
    long: bool


@dataclass
class Freeze:
    """One freeze done: stopped (every thread in T) at ``t_stopped``, resumed at ``t_resumed``
    (``time.monotonic``); ``t_signalled`` is when SIGSTOP was sent."""

    target: str
    long: bool
    duration_s: float
    t_signalled: float
    t_stopped: float
    t_resumed: float = 0.0


def plan_freezes(
    rng: random.Random,
    targets: list[str],
    count: int,
    timeout_s: float,
    window: tuple[float, float],
) -> list[Planned]:
    """``count`` freezes of ``targets`` (picked at random) at random times in ``window`` (s
    into the run), sorted by time; every other one long (module docstring)."""
    lo, hi = window
    if count <= 0 or not targets or hi <= lo:
        return []
    times = sorted(rng.uniform(lo, hi) for _ in range(count))
    plan = []
    for i, at in enumerate(times):
        long = i % 2 == 0
        if long:
            duration = timeout_s + rng.uniform(0.5, FREEZE_EXTRA_S)
        else:
            duration = timeout_s * rng.uniform(*SHORT_FRACTION)
        plan.append(Planned(rng.choice(targets), at, duration, long))
    return plan


class Freezer:
    """Runs a freeze schedule against ``pids`` (target name -> pid) on a daemon thread."""

    def __init__(self, name: str, plan: list[Planned], pids: dict[str, int]) -> None:
        self.plan = plan
        self.pids = pids
        self.done: list[Freeze] = []
        self.skipped = 0  # planned freezes that could not start before their window closed
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._frozen: int | None = None  # pid stopped right now
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"freezer-{name}", daemon=True)
        self._started = 0.0
        self._latest = 0.0

    def start(self, started: float, latest_s: float) -> None:
        """Begin the schedule; ``started`` is the run's ``time.monotonic`` start, ``latest_s``
        the last second of the run a freeze may still begin."""
        self._started, self._latest = started, latest_s
        self._thread.start()

    def _run(self) -> None:
        for planned in self.plan:
            if self._stop.wait(max(0.0, self._started + planned.at - time.monotonic())):
                return
            if time.monotonic() - self._started > self._latest:
                self.skipped += 1
                continue
            try:
                self._freeze(planned)
            except Exception as exc:  # a stop that timed out, a process gone: a problem
                logger.exception("freezing %s failed", planned.target)
                self.problems.append(f"freezing {planned.target} failed: {exc!r}")
                self._resume()

    def _freeze(self, planned: Planned) -> None:
        pid = self.pids[planned.target]
        with self._lock:
            if self._stop.is_set():
                return
            self._frozen = pid
        signalled = time.monotonic()
        stop_process(pid, timeout_s=STOP_TIMEOUT_S)  # returns once every thread is in T
        freeze = Freeze(planned.target, planned.long, planned.duration_s, signalled, 0.0)
        freeze.t_stopped = time.monotonic()
        self.done.append(freeze)
        logger.info("froze %s for %.2f s", planned.target, planned.duration_s)
        self._stop.wait(planned.duration_s)
        self._resume()
        freeze.t_resumed = time.monotonic()

    def _resume(self) -> None:
        with self._lock:
            pid, self._frozen = self._frozen, None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the schedule and resume what is frozen; waits up to ``timeout_s``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self._resume()
        for freeze in self.done:
            if not freeze.t_resumed:
                freeze.t_resumed = time.monotonic()

    def summary(self, timeout_s: float) -> dict[str, Any]:
        """Counts for the report: planned, done, long (past ``timeout_s``), skipped."""
        return {
            "planned": len(self.plan),
            "done": len(self.done),
            "long": sum(f.long for f in self.done),
            "skipped": self.skipped,
            "timeout_s": timeout_s,
            "longest_s": max((f.t_resumed - f.t_stopped for f in self.done), default=0.0),
        }


def unexplained_calls(
    calls: list[tuple[float, float, str]], freezes: list[Freeze], slack_s: float
) -> list[tuple[float, float, str]]:
    """The failed calls (``(t0, t1, reason)``) whose span overlaps no freeze of ``freezes``,
    each extended by ``slack_s`` past its resume (a lost session is noticed after that)."""
    spans = [(f.t_signalled, f.t_resumed + slack_s) for f in freezes]
    return [c for c in calls if not any(c[0] <= hi and c[1] >= lo for lo, hi in spans)]
