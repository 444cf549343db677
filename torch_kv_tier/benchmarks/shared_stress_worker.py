"""The child processes of ``torch-kv-tier shared-stress`` (``shared_stress``): one tier each,
writer or reader rounds against a shared pool, and the checks of every block a reader loads.

A child builds the table of every key's block (``block_table``: a pure function of the key),
connects its own ``TierManager`` (its own NIXL agent), reports ``ready``, waits for the start
signal, runs its rounds for ``Params.seconds`` and sends its ``Counts`` (or its traceback) on
the results queue. Single-threaded; every future is awaited with ``RESULT_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.reliability_concurrency import make_block, read_block

RESULT_TIMEOUT_S = 30.0  # one store/load future
STARTUP_TIMEOUT_S = 180.0  # every child connected (spawned interpreters import torch and NIXL)
MAX_WRONG_SAMPLES = 5  # wrong blocks described per process
# the Counts fields added up over the processes
SUMMED: tuple[str, ...] = ("calls", "verified", "wrong", "missing", "injected", "idle", "stored")
SUMMED += ("late", "late_wrong", "blocks_written", "capacity", "pins_expired")


@dataclass(frozen=True)
class Params:
    """What every child needs: the workload's shape (picklable for ``spawn``)."""

    keys: int = 2048
    block_len: int = 4096
    max_batch: int = 64
    seconds: float = 60.0
    seed: int = 0
    self_check: bool = False


@dataclass
class Counts:
    """One process's figures; readers fill the load side, writers the store side."""

    role: str
    index: int
    calls: int = 0
    verified: int = 0  # loaded blocks equal to their key's block
    wrong: int = 0  # loaded blocks that are not
    missing: int = 0  # keys a load reported "missing"
    late: int = 0  # of those, blocks that were read all the same (the read outlived its pin)
    late_wrong: int = 0  # of those, blocks that were not the key's block
    injected: int = 0  # blocks corrupted on purpose (--self-check)
    idle: int = 0  # reader rounds with no key believed stored
    stored: int = 0  # keys a store call reported ok (sent now, or stored by anyone already)
    blocks_written: int = 0  # blocks this process actually wrote to the host
    capacity: int = 0  # keys a store reported "capacity"
    pins_expired: int = 0  # the tier's count of reads that outlived their pin
    other: dict[str, int] = field(default_factory=dict)  # any other failure reason -> keys
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


def _corrupt(table: np.ndarray, keys: list[int], rows: np.ndarray) -> int:
    """``--self-check``: flip a payload bit of the first row, give the second another key's
    valid block (at least two rows); returns how many rows were corrupted."""
    rows[0, -1] ^= 1
    rows[1] = table[(keys[1] + 1) % len(table)]
    return 2


def _writer_round(tier: Any, table: np.ndarray, rng: random.Random, counts: Counts) -> None:
    keys = rng.sample(range(len(table)), rng.randint(1, tier.arena.num_blocks))
    tier.arena.tensor[: len(keys)].numpy()[:] = table[keys]
    result = tier.store(keys, range(len(keys))).result(timeout=RESULT_TIMEOUT_S)
    counts.stored += len(result.keys)
    counts.blocks_written += result.nbytes // table.shape[1]
    for reason in result.failed.values():
        if reason == "capacity":
            counts.capacity += 1
        else:
            counts.other[reason] = counts.other.get(reason, 0) + 1


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
    result = tier.load(keys, local).result(timeout=RESULT_TIMEOUT_S)
    for reason in result.failed.values():
        if reason == "missing":
            counts.missing += 1
        else:
            counts.other[reason] = counts.other.get(reason, 0) + 1
    _check_late(table, result.failed, keys, local, arena, counts)
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


def _check_late(
    table: np.ndarray,
    failed: dict[Any, str],
    keys: list[int],
    local: list[int],
    arena: np.ndarray,
    counts: Counts,
) -> None:
    """Count the blocks reported missing that were read all the same (their destination is no
    longer zeroed: the read outlived its pin), and how many of them are wrong."""
    gone = [(k, i) for k, i in zip(keys, local) if failed.get(k) == "missing"]
    if not gone:
        return
    rows = arena[[i for _, i in gone]]
    late = rows.any(axis=1)
    counts.late += int(late.sum())
    expected = table[[k for k, _ in gone]]
    counts.late_wrong += int((late & ~(rows == expected).all(axis=1)).sum())


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
    from torch_kv_tier.manager import TierManager

    counts = Counts(role, index)
    try:
        table = block_table(params.keys, params.block_len)
        rng = random.Random(f"{params.seed}-{role}-{index}")
        with TierManager.create(params.max_batch, params.block_len, name=f"{role}-{index}") as tier:
            tier.connect(address)
            results.put(("ready", role, index, None))
            if not start.wait(STARTUP_TIMEOUT_S):
                raise TimeoutError(f"no start signal within {STARTUP_TIMEOUT_S} s")
            self_check = params.self_check and index == 0
            deadline = time.monotonic() + params.seconds
            while time.monotonic() < deadline:
                if not tier.peers():
                    raise RuntimeError("the tier lost the host (see its log above)")
                counts.calls += 1
                if role == "writer":
                    _writer_round(tier, table, rng, counts)
                else:
                    _reader_round(tier, table, rng, counts, self_check)
            counts.pins_expired = tier.stats().verify_failed
        results.put(("done", role, index, asdict(counts)))
    except BaseException:
        results.put(("error", role, index, traceback.format_exc()))
