"""Soak: a long stream of store/load transfers through one tier, watched for leaks and drift.

The stream never reuses a key, so the remote lease fills and the tier evicts continuously: the
index, the slot pool and the event log are all exercised at their bound. Every loaded block is
compared with the block it was stored from. Figures: resident memory (this process and the
server) after warm-up versus the end, the largest in-flight/queued/index sizes seen, and
throughput in the first versus the last tenth of the transfers.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from torch_kv_tier.benchmarks.reliability_common import (
    TCP_ENV,
    Outcome,
    Resources,
    random_blocks,
    ucx_over_tcp,
)
from torch_kv_tier.manager import TierManager, TransferResult
from torch_kv_tier.remote import ServerProcess

SAMPLES = 100  # resource samples over the run (one per 1 % of the transfers)
SOURCE = 64  # source blocks; key k is stored from block k % SOURCE


@dataclass(frozen=True)
class Sample:
    transfers: int
    at: float
    rss: int
    server_rss: int
    threads: int
    fds: int


@dataclass
class _Pending:
    kind: str  # "store" or "load"
    future: Future[TransferResult]
    first_key: int  # keys first_key .. first_key + batch - 1
    dst: int  # first destination block of a load


def soak(
    transfers: int,
    *,
    block_len: int = 4096,
    batch: int = 4,
    window: int = 16,
    lease: int = 1024,
    tcp: bool = False,
    rss_growth_limit_pct: float = 5.0,
    throughput_floor: float | None = 0.75,
    warmup_fraction: float = 0.1,
) -> Outcome:
    """Run ``transfers`` transfers (half stores, half loads, ``batch`` blocks each, ``window``
    calls in flight) through a tier leasing ``lease`` slots of a ``torch-kv-tier serve``.

    ``tcp`` uses UCX over TCP (transfers really in flight); otherwise UCX picks (shared
    memory on one host). Held to: RSS growth after ``warmup_fraction`` of the run below
    ``rss_growth_limit_pct``; last-tenth throughput at least ``throughput_floor`` of the first
    (``None``: reported only; a short run on a busy machine measures its neighbours).
    """
    out = Outcome(
        "soak",
        {
            "transfers": transfers,
            "block_len": block_len,
            "batch": batch,
            "window": window,
            "lease": lease,
            "transport": "UCX tcp" if tcp else "UCX default",
        },
    )
    started = time.monotonic()
    env = TCP_ENV if tcp else {}
    with (
        ucx_over_tcp() if tcp else contextlib.nullcontext(),
        ServerProcess.start(lease, block_len, env=env) as server,
        TierManager.create(
            SOURCE + window * 2 * batch, block_len, name="soak", events=True
        ) as tier,
    ):
        tier.connect(server.address, private=True)
        samples, bounds = _stream(tier, server.proc.pid, transfers, batch, window, out)
    _figures(out, samples, bounds, transfers, lease, window, warmup_fraction)
    out.at_most(
        "RSS growth after warm-up",
        _growth(samples, warmup_fraction, "rss"),
        rss_growth_limit_pct,
        "%",
    )
    out.at_most(
        "server RSS growth after warm-up",
        _growth(samples, warmup_fraction, "server_rss"),
        rss_growth_limit_pct,
        "%",
    )
    first, last = _rate(samples, 0.0, 0.1), _rate(samples, 0.9, 1.0)
    out.info("throughput first tenth", round(first), "transfers/s")
    out.info("throughput last tenth", round(last), "transfers/s")
    ratio = round(last / first, 3) if first else 0.0
    if throughput_floor is None:
        out.info("throughput last/first tenth", ratio)
    else:
        out.at_least("throughput last/first tenth", ratio, throughput_floor)
    out.seconds = time.monotonic() - started
    return out


def _stream(
    tier: TierManager, server_pid: int, transfers: int, batch: int, window: int, out: Outcome
) -> tuple[list[Sample], dict[str, int]]:
    """Alternate stores of fresh keys and loads of the newest stored batch, ``window`` calls in
    flight, until ``transfers`` calls (one transfer each: one peer) have finished."""
    tensor = tier.arena.tensor
    tensor[:SOURCE].copy_(random_blocks(SOURCE, tier.arena.block_len, seed=11))
    source = tensor[:SOURCE].clone()
    ring = (tier.arena.num_blocks - SOURCE) // batch  # load destinations, reused in turn
    pending: deque[_Pending] = deque()
    bounds = dict.fromkeys(("inflight", "queued", "keys", "transport", "loaded", "verified"), 0)
    samples: list[Sample] = []
    every = max(1, transfers // SAMPLES)
    stores = loads = completed = failed = 0
    stored_upto = 0  # keys [0, stored_upto) are stored: their store futures resolved
    while completed < transfers:
        if completed >= len(samples) * every:
            samples.append(_sample(completed, server_pid))
            _track(tier, bounds)
        if len(pending) >= window or stores + loads >= transfers:
            item = pending.popleft()
            result = item.future.result(timeout=30)
            completed += 1
            if not result.ok:
                failed += 1
                out.problem(f"{item.kind} of keys {item.first_key}..: {result.failed}")
            elif item.kind == "store":
                stored_upto = max(stored_upto, item.first_key + batch)
            else:
                bounds["loaded"] += batch
                bounds["verified"] += _verify(tensor, source, item, batch)
        elif stores <= loads or not stored_upto:
            first = stores * batch
            src = [k % SOURCE for k in range(first, first + batch)]
            future = tier.store(range(first, first + batch), src)
            pending.append(_Pending("store", future, first, -1))
            stores += 1
        else:
            first = stored_upto - batch
            dst = SOURCE + (loads % ring) * batch
            future = tier.load(range(first, first + batch), range(dst, dst + batch))
            pending.append(_Pending("load", future, first, dst))
            loads += 1
    samples.append(_sample(completed, server_pid))
    _track(tier, bounds)
    stats = tier.stats()
    bounds["failed_calls"] = failed
    bounds["events_dropped"] = stats.events_dropped
    bounds["transfers_counted"] = stats.transfers_done + stats.transfers_failed
    return samples, bounds


def _track(tier: TierManager, bounds: dict[str, int]) -> None:
    """Fold the tier's table sizes into ``bounds``; drain its events as a scheduler would."""
    stats = tier.stats()
    bounds["inflight"] = max(bounds["inflight"], stats.inflight)
    bounds["queued"] = max(bounds["queued"], stats.queued)
    bounds["keys"] = max(bounds["keys"], stats.keys)
    inflight = tier.transport.inflight_count()  # type: ignore[attr-defined]
    bounds["transport"] = max(bounds["transport"], inflight)
    tier.take_events()


def _verify(tensor: torch.Tensor, source: torch.Tensor, item: _Pending, batch: int) -> int:
    """Blocks of a finished load equal to their source blocks."""
    got = tensor[item.dst : item.dst + batch]
    want = source[[(item.first_key + i) % SOURCE for i in range(batch)]]
    return int((got == want).all(dim=1).sum())


def _sample(transfers: int, server_pid: int) -> Sample:
    me = Resources.of()
    return Sample(
        transfers, time.monotonic(), me.rss, Resources.of(server_pid).rss, me.threads, me.fds
    )


def _after_warmup(samples: Sequence[Sample], warmup_fraction: float) -> list[Sample]:
    total = samples[-1].transfers
    return [s for s in samples if s.transfers >= warmup_fraction * total]


def _growth(samples: Sequence[Sample], warmup_fraction: float, field: str) -> float:
    """Percent growth of ``field`` from the first sample after warm-up to the last sample."""
    steady = _after_warmup(samples, warmup_fraction)
    first, last = getattr(steady[0], field), getattr(steady[-1], field)
    return round(100.0 * (last - first) / first, 2)


def _rate(samples: Sequence[Sample], lo: float, hi: float) -> float:
    """Transfers per second between fractions ``lo`` and ``hi`` of the run."""
    total = samples[-1].transfers
    inside = [s for s in samples if lo * total <= s.transfers <= hi * total]
    span = inside[-1].at - inside[0].at
    return (inside[-1].transfers - inside[0].transfers) / span if span > 0 else 0.0


def _figures(
    out: Outcome,
    samples: Sequence[Sample],
    bounds: dict[str, int],
    transfers: int,
    lease: int,
    window: int,
    warmup_fraction: float,
) -> None:
    seconds = samples[-1].at - samples[0].at
    steady = _after_warmup(samples, warmup_fraction)
    out.info("transfers per second", round(samples[-1].transfers / seconds, 1) if seconds else 0)
    out.equals("transfers counted by the tier", bounds["transfers_counted"], transfers)
    out.equals("failed calls", bounds["failed_calls"], 0)
    out.equals("loaded blocks byte-identical", bounds["verified"], bounds["loaded"])
    out.at_most("largest tier in-flight table", bounds["inflight"], window)
    out.at_most("largest tier queue", bounds["queued"], window)
    out.at_most("largest transport in-flight table", bounds["transport"], window)
    out.at_most("largest index (keys)", bounds["keys"], lease)
    out.equals("events dropped", bounds["events_dropped"], 0)
    out.info("RSS after warm-up", round(steady[0].rss / 2**20, 1), "MiB")
    out.info("RSS at the end", round(samples[-1].rss / 2**20, 1), "MiB")
    out.at_most("threads grown after warm-up", steady[-1].threads - steady[0].threads, 0)
    out.at_most("fds grown after warm-up", steady[-1].fds - steady[0].fds, 0)
