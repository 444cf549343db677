"""The frozen-writer scenario (issue 17): a writer stopped mid-store must never corrupt the
blocks a host hands to the next writer.

On a real ``torch-kv-tier serve --lease-timeout 1``, writer A (its own process,
``frozen_writer_client``) takes the whole pool (a private lease of every slot, or the shared
pool with grants of the whole pool), fills its arena with ``0xAA``, posts stores and stops
itself with SIGSTOP while they are in flight. The host is stopped while A posts and resumed
once every thread of A is stopped: over UCX/TCP the target drives a write's completion, so A's
writes are in flight at its freeze by construction, not by the speed of the wire. Then tier B
(this process) takes the same slots (retrying ``no free slots``), stores its keys (each block
``0xBB`` with its key's number in front; ``capacity`` is retried) until all are stored or the
freeze is nearly over. A stays frozen for ``freeze_s``, longer than every timeout (the lease
timeout, A's heartbeat timeout), then gets SIGCONT: its posted writes go on, it posts more, and
it reports once every future of its settled and its transport is quiet. B then loads every key
it stored.

What must hold (``Outcome.problems`` otherwise):

* no load of B's reports ``ok`` for a block whose bytes are not the ones its key was stored
  with (``wrong blocks`` is 0);
* every future, A's and B's, settles within its bound;
* the host did not lose the slots for good: within ``recover_s`` after A settled, B leases the
  whole pool again (private) or stores fresh keys (shared), and loads every one byte-correct;
* the setup hit the race: over UCX/TCP A's stores were in flight at the freeze (its tier's
  ``stats()`` just before the stop), and while A was frozen the host ended its session
  with slots held for it (its ``held_blocks``, read after B stored: slots A may still write,
  which B's stores would have taken without the fence); otherwise the setup is retried, up to
  ``attempts`` times. Whether B was refused at first (a handshake, or stores failing with
  ``capacity``) is only reported: it depends on how many of A's writes had completed and been
  committed (evictable, not held) before the freeze, that is on write speed.

Legitimate outcomes besides success: B refused (``no free slots``) or its stores failing with
``capacity`` while A may still write, and loads reported ``missing``; they are reported as
figures. Every child process is killed on every exit path. B's part (connect, store, load back,
recover) is ``frozen_writer_b``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from torch_kv_tier.benchmarks.frozen_writer_b import (
    B_FILL,
    HELD_FIGURE,
    check_loads,
    fill_while_frozen,
    recover,
)
from torch_kv_tier.benchmarks.reliability_common import (
    TCP_ENV,
    LineReader,
    Outcome,
    all_stopped,
    kill_process,
    stop_process,
    ucx_over_tcp,
    wait_until,
)
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

logger = logging.getLogger(__name__)

CHILD_START_S = 120.0  # A imports torch and NIXL, connects and stores its warm-up key
POST_S = 10.0  # A posts its stores and stops itself, while the host is stopped
SETTLE_S = 60.0  # A's report after SIGCONT (its futures take up to 30 s, its transport 15 s)


@dataclass(frozen=True)
class Setup:
    """One run's shape. ``freeze_s`` must exceed ``2 * lease_timeout_s`` (well past the lease,
    which is all that timing can end: the host holds A's slots after it) and
    ``heartbeat_timeout_s`` (A's, of the host)."""

    private: bool
    tcp: bool
    num_blocks: int = 256
    block_len: int = 262144
    lease_timeout_s: float = 1.0
    heartbeat_timeout_s: float = 2.0
    freeze_s: float = 5.0
    recover_s: float = 30.0
    attempts: int = 3

    @property
    def b_keys(self) -> int:
        """B's keys: the whole pool (private); three quarters of it (shared: B's own grants
        and A's committed warm-up key take slots too)."""
        return self.num_blocks if self.private else 3 * self.num_blocks // 4

    def writer_args(self, address: str) -> list[str]:
        n = self.num_blocks
        per_store = [str(n // 4), str(n // 4)] if self.private else [str(n // 8), str(n // 8 - 1)]
        args = [address, "--num-blocks", str(n), "--block-len", str(self.block_len)]
        args += ["--grant-batch", str(n), "--first", per_store[0], "--second", per_store[1]]
        args += ["--heartbeat-timeout", str(self.heartbeat_timeout_s)]
        return args + (["--private"] if self.private else [])


def frozen_writer(setup: Setup) -> Outcome:
    """Run the scenario (module docstring); a setup that missed the race is run again, up to
    ``setup.attempts`` times, and the last attempt's outcome is returned."""
    started = time.monotonic()
    for attempt in range(1, setup.attempts + 1):
        out = Outcome(
            "frozen writer",
            {
                "pool": "private lease" if setup.private else "shared pool",
                "transport": "UCX tcp" if setup.tcp else "UCX default (shared memory)",
                "num_blocks": setup.num_blocks,
                "block_len": setup.block_len,
                "lease_timeout_s": setup.lease_timeout_s,
                "freeze_s": setup.freeze_s,
                "attempt": attempt,
            },
        )
        _trial(setup, out)
        missed = [f for f in out.figures if f.name in RACE_FIGURES and not f.ok]
        if out.problems or not missed:
            break
        missed_text = ", ".join(f"{f.name}: {f.text()}" for f in missed)
        logger.warning("attempt %d missed the race (%s): set up again", attempt, missed_text)
    out.seconds = time.monotonic() - started
    return out


# The figures that say a setup hit the race under test (retried otherwise).
RACE_FIGURES = ("A's stores in flight at the freeze", HELD_FIGURE)


def _trial(setup: Setup, out: Outcome) -> None:
    """One setup, recorded in ``out``."""
    env = TCP_ENV if setup.tcp else {}
    extra = ["--lease-timeout", str(setup.lease_timeout_s), "--max-grant", str(setup.num_blocks)]
    with (
        ucx_over_tcp() if setup.tcp else contextlib.nullcontext(),
        ServerProcess.start(setup.num_blocks, setup.block_len, extra_args=extra, env=env) as host,
    ):
        cmd = [sys.executable, "-m", "torch_kv_tier.benchmarks.frozen_writer_client"]
        writer = subprocess.Popen(
            cmd + setup.writer_args(host.address),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        try:
            lines = LineReader(writer.stdout)
            if _event(lines, "ready", CHILD_START_S, out) is None:
                return
            posted = _post_with_the_host_stopped(writer, host.proc.pid, lines, out)
            if posted is None:
                return
            frozen_at = time.monotonic()
            _record_posted(posted, setup.tcp, out)
            # B asks for small grants: a refill of the whole pool would evict B's own keys
            tier = TierManager.create(
                setup.num_blocks,
                setup.block_len,
                name="frozen-b",
                grant_batch=setup.num_blocks // 8,
            )
            with tier:
                stored = fill_while_frozen(tier, host.address, setup, frozen_at, out)
                time.sleep(max(0.0, frozen_at + setup.freeze_s - time.monotonic()))
                os.kill(writer.pid, signal.SIGCONT)
                settled = _event(lines, "settled", SETTLE_S, out)
                if settled is not None:
                    _record_settled(settled, out)
                check_loads(tier, stored, B_FILL, setup.block_len, out, "after A resumed")
                recover(tier, host.address, setup, out)
            assert writer.stdin is not None
            writer.stdin.write("exit\n")
            writer.stdin.flush()
            try:
                writer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                out.problem("A did not exit within 30 s of being told to")
            if host.proc.poll() is not None:
                out.problem(f"the host exited with code {host.proc.returncode}")
        finally:
            kill_process(writer)


def _post_with_the_host_stopped(
    writer: subprocess.Popen[str], host_pid: int, lines: LineReader, out: Outcome
) -> dict[str, Any] | None:
    """Tell A to post its stores while the host is stopped, and resume the host once A stopped
    itself: over UCX/TCP the target drives a write's completion, so every write A posted is
    still in flight at its freeze, whatever the speed of the wire. A's ``posted`` event, or
    ``None`` (and a problem)."""
    assert writer.stdin is not None
    stop_process(host_pid)
    try:
        writer.stdin.write("post\n")
        writer.stdin.flush()
        posted = _event(lines, "posted", POST_S, out)
        if posted is not None and not wait_until(
            lambda: all_stopped(writer.pid), POST_S, interval_s=0.001
        ):
            out.problem(f"A did not stop itself within {POST_S:.0f} s of posting")
            return None
        return posted
    finally:
        os.kill(host_pid, signal.SIGCONT)


def _event(lines: LineReader, name: str, timeout_s: float, out: Outcome) -> dict[str, Any] | None:
    """A's next JSON line, which must be event ``name``; ``None`` (and a problem) otherwise."""
    try:
        line = lines.next_line(timeout_s)
    except TimeoutError:
        out.problem(f"A reported no {name!r} within {timeout_s:.0f} s: it hangs")
        return None
    if line is None:
        out.problem(f"A exited before reporting {name!r}")
        return None
    event: dict[str, Any] = json.loads(line)
    if event.get("event") != name:
        out.problem(f"A reported {event} instead of {name!r}")
        return None
    return event


def _record_posted(posted: dict[str, Any], tcp: bool, out: Outcome) -> None:
    """A's tier's ``stats()`` just before it stopped: over TCP, some of its writes must still
    be in flight (or queued), else the setup missed the race."""
    inflight = int(posted["inflight"]) + int(posted["queued"])
    if tcp:
        out.at_least("A's stores in flight at the freeze", inflight, 1)
    else:  # over shared memory a write often completes inside transfer(): A's next ones race
        out.info("A's stores in flight at the freeze", inflight)
    out.info("A's store calls already done at the freeze", posted["done"])


def _record_settled(settled: dict[str, Any], out: Outcome) -> None:
    out.equals("A's futures unsettled after its resume", settled["unsettled"], 0)
    for batch in ("first", "second"):
        for reason, keys in sorted(settled[batch].items()):
            out.info(f"A's {batch} keys: {reason}", keys)
    out.info("A's writes in flight when it settled", settled["inflight"])


__all__ = ["HELD_FIGURE", "Setup", "frozen_writer"]
