"""The child processes of ``torch-kv-tier shared-stress`` (``shared_stress``): one tier each,
writer or reader rounds against a shared pool, and the checks of every block a reader loads.

A child builds the table of every key's block (``block_table``: a pure function of the key),
connects its own ``TierManager`` (its own NIXL agent), reports ``ready``, waits for the start
signal, runs its rounds for ``Params.seconds`` and sends its ``Counts`` (or its traceback) on
the results queue. Single-threaded; every future is awaited with ``RESULT_TIMEOUT_S`` (one that
does not settle by then is a hang: the child fails with the call and the tier's stats).

Faults (``shared_stress_faults``) freeze the host or this process under it, so the tier may have
no peer for a while (it dropped the host and is dialling it again): a round then first waits,
at most ``PEER_WAIT_S``, for ``tier.peers()`` to come back (counted in ``peer_waits``). A key
that failed with a fault's reason ("peer lost", "transfer failed", "no peers") is counted, and
the call's span (``time.monotonic``, the same clock in every process) is kept in
``fault_calls`` so that the parent can check it overlapped a fault.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.reliability_concurrency import make_block, read_block

# one store/load future: a load of a frozen host's key settles once the host resumes (at most
# Params.heartbeat_timeout_s + FREEZE_EXTRA_S later), plus the re-dial and a loaded machine
RESULT_TIMEOUT_S = 60.0
PEER_WAIT_S = 90.0  # the tier re-dials a dropped host (backoff up to 10 s, handshake 10 s)
STARTUP_TIMEOUT_S = 180.0  # every child connected (spawned interpreters import torch and NIXL)
MAX_WRONG_SAMPLES = 5  # wrong blocks described per process
MAX_FAULT_CALLS = 2000  # spans of calls that failed with a fault's reason, kept per process
# The reasons a key may fail with around a fault (see shared_stress's docstring).
FAULT_REASONS = ("peer lost", "transfer failed", "no peers")
# the Counts fields added up over the processes
SUMMED: tuple[str, ...] = ("calls", "verified", "wrong", "missing", "rejected", "rejected_wrong")
SUMMED += ("verify_failed", "injected", "idle", "stored", "blocks_written", "capacity")
SUMMED += ("fault_failed", "peer_waits")


@dataclass(frozen=True)
class Params:
    """What every child needs: the workload's shape (picklable for ``spawn``)."""

    keys: int = 2048
    block_len: int = 4096
    max_batch: int = 64
    seconds: float = 60.0
    seed: int = 0
    self_check: bool = False
    heartbeat_timeout_s: float = 10.0  # the tier's: a host silent this long is dropped
    compact_index: bool | None = None  # the tiers' copy of the host's index (None: their default)


@dataclass
class Counts:
    """One process's figures; readers fill the load side, writers the store side."""

    role: str
    index: int
    calls: int = 0
    verified: int = 0  # loaded blocks equal to their key's block
    wrong: int = 0  # loaded blocks that are not
    missing: int = 0  # keys a load reported "missing"
    rejected: int = 0  # of those, blocks whose destination was written (failed verification)
    rejected_wrong: int = 0  # of those, blocks that were not their key's block
    verify_failed: int = 0  # the tier's stats().verify_failed at the end
    injected: int = 0  # blocks corrupted on purpose (--self-check)
    idle: int = 0  # reader rounds with no key believed stored
    stored: int = 0  # keys a store call reported ok (sent now, or stored by anyone already)
    blocks_written: int = 0  # blocks this process actually wrote to the host
    capacity: int = 0  # keys a store reported "capacity"
    fault_failed: int = 0  # keys that failed with one of FAULT_REASONS
    peer_waits: int = 0  # rounds that found the tier without a peer and waited for it
    peer_wait_max_s: float = 0.0  # the longest such wait
    max_call_s: float = 0.0  # the longest time a future took to settle
    unreleased_sessions: int = 0  # the tier's stats().unreleased_sessions at the end
    failures: dict[str, int] = field(default_factory=dict)  # keys by FAULT_REASONS reason
    other: dict[str, int] = field(default_factory=dict)  # any other failure reason -> keys
    fault_calls: list[tuple[float, float, str]] = field(default_factory=list)  # (t0, t1, why)
    wrong_samples: list[str] = field(default_factory=list)


def block_table(num_keys: int, block_len: int) -> np.ndarray:
    """Every key's block, row ``k`` for key ``k`` (the same in every process)."""
    return np.stack([make_block(k, k, block_len) for k in range(num_keys)])


def check_blocks(table: np.ndarray, keys: list[int], rows: np.ndarray, counts: Counts) -> None:
    """Count ``rows`` (loaded for ``keys``) verified or wrong; describe the first wrong ones."""
    good = (rows == table[keys]).all(axis=1)
    counts.verified += int(good.sum())
    for i in np.flatnonzero(~good):
        counts.wrong += 1
        if len(counts.wrong_samples) < MAX_WRONG_SAMPLES:
            key_id, _, crc_ok = read_block(rows[i])
            counts.wrong_samples.append(
                f"key {keys[i]}: block carries key id {key_id}, CRC {'ok' if crc_ok else 'BAD'}"
            )


def check_rejected(
    table: np.ndarray,
    failed: dict[Any, str],
    keys: list[int],
    local: list[int],
    arena: np.ndarray,
    counts: Counts,
) -> None:
    """Count the keys reported "missing" whose destination row (zeroed before the load) was
    written all the same: the read landed and failed verification (``rejected``); and how many
    of those rows were indeed not their key's block (``rejected_wrong``: what verification kept
    from the caller)."""
    gone = [(k, i) for k, i in zip(keys, local) if failed.get(k) == "missing"]
    if not gone:
        return
    rows = arena[[i for _, i in gone]]
    landed = rows.any(axis=1)
    counts.rejected += int(landed.sum())
    expected = table[[k for k, _ in gone]]
    counts.rejected_wrong += int((landed & ~(rows == expected).all(axis=1)).sum())


def _corrupt(table: np.ndarray, keys: list[int], rows: np.ndarray) -> int:
    """``--self-check``: flip a payload bit of the first row, give the second another key's
    valid block (at least two rows); returns how many rows were corrupted."""
    rows[0, -1] ^= 1
    rows[1] = table[(keys[1] + 1) % len(table)]
    return 2


def _settle(tier: Any, what: str, future: Future[Any], counts: Counts, t0: float) -> Any:
    """``future``'s result within ``RESULT_TIMEOUT_S``; a hang raises with the tier's state."""
    try:
        result = future.result(timeout=RESULT_TIMEOUT_S)
    except FutureTimeout:
        raise TimeoutError(
            f"{what} did not settle within {RESULT_TIMEOUT_S} s; peers {tier.peers()}, "
            f"stats {tier.stats()}"
        ) from None
    counts.max_call_s = max(counts.max_call_s, time.monotonic() - t0)
    return result


def _count_failures(failed: dict[Any, str], legit: str, counts: Counts, t0: float) -> None:
    """Count the reasons of ``failed`` keys: ``legit`` ("missing"/"capacity"), a fault's
    reason (with the call's span) or another one."""
    faulted = ""
    for reason in failed.values():
        if reason == legit:
            if legit == "capacity":
                counts.capacity += 1
            else:
                counts.missing += 1
        elif reason in FAULT_REASONS:
            counts.fault_failed += 1
            counts.failures[reason] = counts.failures.get(reason, 0) + 1
            faulted = reason
        else:
            counts.other[reason] = counts.other.get(reason, 0) + 1
    if faulted and len(counts.fault_calls) < MAX_FAULT_CALLS:
        counts.fault_calls.append((t0, time.monotonic(), faulted))


def _writer_round(tier: Any, table: np.ndarray, rng: random.Random, counts: Counts) -> None:
    keys = rng.sample(range(len(table)), rng.randint(1, tier.arena.num_blocks))
    tier.arena.tensor[: len(keys)].numpy()[:] = table[keys]
    t0 = time.monotonic()
    future = tier.store(keys, range(len(keys)))
    result = _settle(tier, f"store of {len(keys)} keys", future, counts, t0)
    counts.stored += len(result.keys)
    counts.blocks_written += result.nbytes // table.shape[1]
    _count_failures(result.failed, "capacity", counts, t0)


def _reader_round(
    tier: Any, table: np.ndarray, rng: random.Random, counts: Counts, self_check: bool
) -> None:
    want = rng.randint(1, tier.arena.num_blocks)
    candidates = rng.sample(range(len(table)), min(len(table), 4 * want))
    keys = [k for k in candidates if tier.contains(k)][:want]
    if not keys:
        counts.idle += 1
        time.sleep(0.001)
        return
    local = rng.sample(range(tier.arena.num_blocks), len(keys))  # scattered destinations
    arena = tier.arena.tensor.numpy()
    arena[local] = 0  # a load that writes nothing cannot pass for a good one
    t0 = time.monotonic()
    future = tier.load(keys, local)
    result = _settle(tier, f"load of {len(keys)} keys", future, counts, t0)
    _count_failures(result.failed, "missing", counts, t0)
    check_rejected(table, result.failed, keys, local, arena, counts)
    loaded = set(result.keys)
    ok_keys = [k for k in keys if k in loaded]
    ok_local = [i for k, i in zip(keys, local) if k in loaded]
    rows = arena[ok_local]  # a copy: the checks never race the next load
    if self_check and not counts.injected and len(ok_keys) >= 2:  # both kinds, every time
        counts.injected = _corrupt(table, ok_keys, rows)
    check_blocks(table, ok_keys, rows, counts)
    pause = rng.choice((0.0, 0.0, 0.0002, 0.001, 0.005))
    if pause:
        time.sleep(pause)


def wait_for_peer(tier: Any, counts: Counts, timeout_s: float = PEER_WAIT_S) -> None:
    """Return once ``tier`` has a peer again (counted as a wait); ``TimeoutError`` after
    ``timeout_s``: the tier never got its host back."""
    if tier.peers():
        return
    counts.peer_waits += 1
    t0 = time.monotonic()
    while not tier.peers():
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise TimeoutError(f"the tier had no peer for {waited:.1f} s (see its log above)")
        time.sleep(0.01)
    counts.peer_wait_max_s = max(counts.peer_wait_max_s, time.monotonic() - t0)


def _quiet_rejections(record: logging.LogRecord) -> bool:
    """Drop the tier's warning about blocks that failed verification: the pool evicts all the
    time, so there are thousands, and each is counted (``rejected``, ``verify_failed``)."""
    return "do not hold their keys' bytes" not in str(record.msg)


def worker(
    role: str,
    index: int,
    address: str,
    params: Params,
    start: Any,
    results: Any,
) -> None:
    """A child process: one tier, ``params.seconds`` of writer or reader rounds, then its
    counts (or its error) on ``results``."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {role}-{index} %(message)s")
    logging.getLogger("torch_kv_tier.manager").addFilter(_quiet_rejections)
    from torch_kv_tier.manager import TierManager

    counts = Counts(role, index)
    try:
        table = block_table(params.keys, params.block_len)
        rng = random.Random(f"{params.seed}-{role}-{index}")
        with TierManager.create(
            params.max_batch,
            params.block_len,
            name=f"{role}-{index}",
            compact_index=params.compact_index,
        ) as tier:
            tier.connect(address, heartbeat_timeout_s=params.heartbeat_timeout_s)
            results.put(("ready", role, index, None))
            if not start.wait(STARTUP_TIMEOUT_S):
                raise TimeoutError(f"no start signal within {STARTUP_TIMEOUT_S} s")
            self_check = params.self_check and index == 0
            deadline = time.monotonic() + params.seconds
            while time.monotonic() < deadline:
                wait_for_peer(tier, counts)
                counts.calls += 1
                if role == "writer":
                    _writer_round(tier, table, rng, counts)
                else:
                    _reader_round(tier, table, rng, counts, self_check)
            stats = tier.stats()
            counts.verify_failed = stats.verify_failed
            counts.unreleased_sessions = stats.unreleased_sessions
        results.put(("done", role, index, asdict(counts)))
    except BaseException:
        results.put(("error", role, index, traceback.format_exc()))
