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
figures. Every child process is killed on every exit path.
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
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.reliability_common import (
    TCP_ENV,
    LineReader,
    Outcome,
    all_stopped,
    kill_process,
    server_stats,
    stop_process,
    ucx_over_tcp,
    wait_until,
)
from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager, TransferResult
from torch_kv_tier.remote import HandshakeRejected, ServerProcess
from torch_kv_tier.results import CAPACITY

logger = logging.getLogger(__name__)

RESULT_TIMEOUT_S = 30.0  # one store/load future of B's
CHILD_START_S = 120.0  # A imports torch and NIXL, connects and stores its warm-up key
POST_S = 10.0  # A posts its stores and stops itself, while the host is stopped
SETTLE_S = 60.0  # A's report after SIGCONT (its futures take up to 30 s, its transport 15 s)
B_FILL, RECOVERY_FILL, A_FILL = 0xBB, 0xCC, 0xAA


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


def block_of(number: int, fill: int, block_len: int) -> np.ndarray:
    """The block stored under key ``number``: ``fill`` bytes, the number in the first 8."""
    row = np.full(block_len, fill, dtype=np.uint8)
    row[:8] = np.frombuffer(number.to_bytes(8, "little"), dtype=np.uint8)
    return row


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


HELD_FIGURE = "slots the host held for frozen A"
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
                stored = _fill_while_frozen(tier, host.address, setup, frozen_at, out)
                time.sleep(max(0.0, frozen_at + setup.freeze_s - time.monotonic()))
                os.kill(writer.pid, signal.SIGCONT)
                settled = _event(lines, "settled", SETTLE_S, out)
                if settled is not None:
                    _record_settled(settled, out)
                _check_loads(tier, stored, B_FILL, setup.block_len, out, "after A resumed")
                _recover(tier, host.address, setup, out)
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


def _settle(future: Future[TransferResult], what: str, out: Outcome) -> TransferResult | None:
    """The future's result within ``RESULT_TIMEOUT_S``; a hang is a problem (``None``)."""
    try:
        return future.result(timeout=RESULT_TIMEOUT_S)
    except FutureTimeout:
        out.problem(f"{what}: a future did not settle within {RESULT_TIMEOUT_S:.0f} s")
        return None


def _connect(tier: TierManager, address: str, setup: Setup, deadline: float) -> tuple[str, int]:
    """Connect ``tier`` as A did (private: every slot) retrying ``no free slots`` until
    ``deadline``; returns (peer id, refusals). Raises ``HandshakeRejected`` for another
    reason or at the deadline."""
    refused = 0
    while True:
        try:
            if setup.private:
                return tier.connect(address, private=True, slots=setup.num_blocks), refused
            return tier.connect(address), refused
        except HandshakeRejected as exc:
            if exc.reason != "no free slots" or time.monotonic() >= deadline:
                raise
            refused += 1
            time.sleep(0.05)


def _store_all(
    tier: TierManager,
    numbers: list[int],
    prefix: str,
    fill: int,
    deadline: float,
    out: Outcome,
) -> tuple[dict[Key, int], Counter[str]]:
    """Store key ``f"{prefix}{n}"`` for each of ``numbers`` from local block ``i`` (written
    with ``block_of``), retrying failed keys until ``deadline``; (stored key -> number, every
    failure reason seen)."""
    arena = tier.arena.tensor.numpy()
    for i, n in enumerate(numbers):
        arena[i] = block_of(n, fill, tier.arena.block_len)
    todo: dict[Key, tuple[int, int]] = {f"{prefix}{n}": (i, n) for i, n in enumerate(numbers)}
    stored: dict[Key, int] = {}
    failures: Counter[str] = Counter()
    while todo and time.monotonic() < deadline:
        keys = list(todo)
        for start in range(0, len(keys), 64):
            chunk = keys[start : start + 64]
            result = _settle(tier.store(chunk, [todo[k][0] for k in chunk]), "store", out)
            if result is None:
                return stored, failures
            failures.update(result.failed.values())
            for key in result.keys:
                stored[key] = todo.pop(key)[1]
        if todo:
            time.sleep(0.1)
    return stored, failures


def _fill_while_frozen(
    tier: TierManager, address: str, setup: Setup, frozen_at: float, out: Outcome
) -> dict[Key, int]:
    """B's part while A is frozen: connect, store ``b_keys`` keys; the keys stored."""
    deadline = frozen_at + setup.freeze_s - 0.5
    stored: dict[Key, int] = {}
    try:
        _, refused = _connect(tier, address, setup, deadline)
    except HandshakeRejected as exc:
        out.info(f"B refused for the whole freeze ({exc.reason})", 1)
    else:
        out.info("B's handshakes refused while A was frozen", refused)
        numbers = list(range(setup.b_keys))
        stored, failures = _store_all(tier, numbers, "b-", B_FILL, deadline, out)
        out.info("B's keys stored while A was frozen", len(stored))
        for reason, count in sorted(failures.items()):
            out.info(f"B's store failures while A was frozen: {reason}", count)
        out.info("B's stores refused for capacity while A was frozen", failures[CAPACITY])
    out.at_least(HELD_FIGURE, _held_for_frozen_a(address, setup, deadline), 1)
    return stored


def _held_for_frozen_a(address: str, setup: Setup, deadline: float) -> int:
    """The slots the host holds for A's ended session (its ``held_blocks``), once it ended it
    (by ``deadline``): A's lease reclaimed, or its grants held; 0 if it never did."""
    stats: dict[str, Any] = {}

    def ended() -> bool:
        stats.update(server_stats(address, setup.block_len))
        return int(stats["held_sessions"]) >= 1

    if not wait_until(ended, max(0.0, deadline - time.monotonic()), interval_s=0.05):
        return 0
    return int(stats["held_blocks"])


def _check_loads(
    tier: TierManager, stored: dict[Key, int], fill: int, block_len: int, out: Outcome, when: str
) -> tuple[int, int]:
    """Load every stored key; a block loaded ``ok`` whose bytes differ from its key's is a
    problem. Returns (verified, not loaded)."""
    arena = tier.arena.tensor.numpy()
    keys = list(stored)
    verified = wrong = with_a = 0
    reasons: Counter[str] = Counter()
    for start in range(0, len(keys), 64):
        chunk = keys[start : start + 64]
        arena[: len(chunk)] = 0  # a load that writes nothing cannot pass for a good one
        result = _settle(tier.load(chunk, range(len(chunk))), f"load {when}", out)
        if result is None:
            return verified, len(keys) - verified
        reasons.update(result.failed.values())
        loaded = set(result.keys)
        for i, key in enumerate(chunk):
            if key not in loaded:
                continue
            if np.array_equal(arena[i], block_of(stored[key], fill, block_len)):
                verified += 1
            else:
                wrong += 1
                with_a += bool((arena[i] == A_FILL).all())
    out.equals(f"wrong blocks loaded ok {when}", wrong, 0)
    if wrong:
        out.problem(f"{wrong} of {len(keys)} blocks loaded ok {when} were wrong ({with_a} A's)")
    out.info(f"blocks verified {when}", verified)
    for reason, count in sorted(reasons.items()):
        out.info(f"loads failed {when}: {reason}", count)
    return verified, len(keys) - verified


def _recover(tier: TierManager, address: str, setup: Setup, out: Outcome) -> None:
    """After A settled: within ``recover_s``, B gets the whole pool back (private: a lease of
    every slot) and round-trips fresh keys through it, every one byte-correct."""
    started = time.monotonic()
    deadline = started + setup.recover_s
    want = setup.num_blocks if setup.private else setup.num_blocks // 2
    attempt = 0
    refused: HandshakeRejected | None = None
    while time.monotonic() < deadline:
        attempt += 1
        for peer in tier.peers():
            tier.disconnect(peer)
        try:
            peer, _ = _connect(tier, address, setup, deadline)
        except HandshakeRejected as exc:  # A's release of its held slots may still be on its way
            refused = exc
            time.sleep(0.1)
            continue
        refused = None
        if setup.private and tier.stats().peers[peer].capacity < want:
            time.sleep(0.1)
            continue
        numbers = [1_000_000 * attempt + n for n in range(want)]
        stored, _ = _store_all(tier, numbers, f"r{attempt}-", RECOVERY_FILL, deadline, out)
        if len(stored) == want:
            when = f"in recovery attempt {attempt}"
            _, missed = _check_loads(tier, stored, RECOVERY_FILL, setup.block_len, out, when)
            if not missed:
                took = round(time.monotonic() - started, 2)
                out.at_most("seconds until B used the whole pool again", took, setup.recover_s, "s")
                return
    if refused is not None:
        out.problem(f"after A settled, B stayed refused for {setup.recover_s:.0f} s: {refused}")
        return
    out.problem(f"after A settled, B could not use the whole pool within {setup.recover_s:.0f} s")


__all__ = ["Setup", "block_of", "frozen_writer"]
