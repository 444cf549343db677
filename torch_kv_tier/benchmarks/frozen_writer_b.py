"""Writer B's part of the frozen-writer scenario (``frozen_writer``), in the test's process.

While A is frozen B connects (retrying ``no free slots``) and stores its keys, each block
``block_of`` its key's number; after A resumed B loads them back, and recovers the whole pool.
Every call runs on the caller's thread and waits on each future at most ``RESULT_TIMEOUT_S``;
what goes wrong is recorded in the ``Outcome`` passed in, never raised.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np

from torch_kv_tier.benchmarks.reliability_common import Outcome, server_stats, wait_until
from torch_kv_tier.keys import Key
from torch_kv_tier.manager import TierManager, TransferResult
from torch_kv_tier.remote import HandshakeRejected
from torch_kv_tier.results import CAPACITY

if TYPE_CHECKING:
    from torch_kv_tier.benchmarks.frozen_writer import Setup

RESULT_TIMEOUT_S = 30.0  # one store/load future of B's
B_FILL, RECOVERY_FILL, A_FILL = 0xBB, 0xCC, 0xAA
HELD_FIGURE = "slots the host held for frozen A"


def block_of(number: int, fill: int, block_len: int) -> np.ndarray:
    """The block stored under key ``number``: ``fill`` bytes, the number in the first 8."""
    row = np.full(block_len, fill, dtype=np.uint8)
    row[:8] = np.frombuffer(number.to_bytes(8, "little"), dtype=np.uint8)
    return row


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


def fill_while_frozen(
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


def check_loads(
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


def recover(tier: TierManager, address: str, setup: Setup, out: Outcome) -> None:
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
            _, missed = check_loads(tier, stored, RECOVERY_FILL, setup.block_len, out, when)
            if not missed:
                took = round(time.monotonic() - started, 2)
                out.at_most("seconds until B used the whole pool again", took, setup.recover_s, "s")
                return
    if refused is not None:
        out.problem(f"after A settled, B stayed refused for {setup.recover_s:.0f} s: {refused}")
        return
    out.problem(f"after A settled, B could not use the whole pool within {setup.recover_s:.0f} s")


__all__ = [
    "A_FILL",
    "B_FILL",
    "HELD_FIGURE",
    "block_of",
    "check_loads",
    "fill_while_frozen",
    "recover",
]
