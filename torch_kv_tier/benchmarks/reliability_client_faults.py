"""Fault injection against real ``torch-kv-tier serve`` processes over UCX/TCP: a client dies
or closes.

* ``client_death``: SIGKILL a client process mid-stream; the server holds its lease (the client
  may only be frozen, with writes still to land) until the operator's ``--hold-timeout`` after the
  lease timeout, and a new client must then be able to lease and use those slots.
* ``close_under_load``: ``TierManager.close`` with hundreds of transfers in flight to a stopped
  server must return within its timeout and resolve every future.

A server's death is ``reliability_faults``. Each function owns the processes it starts and kills
them on every exit path.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

from torch_kv_tier.benchmarks.reliability_common import (
    TCP_ENV,
    LineReader,
    Outcome,
    kill_process,
    random_blocks,
    server_stats,
    stop_process,
    ucx_over_tcp,
)
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import HandshakeRejected, ServerProcess


def client_death(
    trials: int,
    *,
    block_len: int = 4096,
    pool: int = 256,
    lease_timeout_s: float = 1.0,
    hold_timeout_s: float = 1.0,
    min_stored: int = 512,
) -> Outcome:
    """``trials`` times: a client process (``torch_kv_tier.benchmarks.reliability_client``) leases
    the whole pool and streams stores; once it stored ``min_stored`` blocks it is SIGKILLed
    mid-stream. A new tier then asks for the whole pool until the server grants it, and round-trips
    a block through every slot of it."""
    out = Outcome(
        "client death",
        {
            "trials": trials,
            "pool": pool,
            "lease_timeout_s": lease_timeout_s,
            "hold_timeout_s": hold_timeout_s,
            "transport": "UCX tcp",
        },
    )
    started = time.monotonic()
    reclaim: list[float] = []
    held_s = lease_timeout_s + hold_timeout_s  # a dead client's lease goes by to nobody
    verified = 0
    with (
        ucx_over_tcp(),
        ServerProcess.start(
            pool,
            block_len,
            extra_args=[
                *("--lease-timeout", str(lease_timeout_s)),
                *("--hold-timeout", str(hold_timeout_s)),
            ],
            env=TCP_ENV,
        ) as server,
    ):
        for trial in range(trials):
            killed_at = _stream_then_kill(server.address, block_len, pool, min_stored, out)
            if killed_at is None:
                break
            got = _reuse_whole_pool(server.address, block_len, pool, killed_at, held_s, out)
            if got is None:
                break
            reclaim.append(got[0])
            verified += got[1]
            if server.proc.poll() is not None:
                out.problem(f"trial {trial}: the server exited with {server.proc.returncode}")
                break
        reclaimed = server_stats(server.address, block_len).get("leases_reclaimed", -1)
    out.equals("trials completed", len(reclaim), trials)
    out.equals("leases reclaimed by the server", reclaimed, trials)
    if reclaim:
        out.at_most("slowest reclaim after SIGKILL", round(max(reclaim), 3), held_s + 1.5, "s")
        out.at_least("fastest reclaim after SIGKILL", round(min(reclaim), 3), held_s / 2, "s")
    out.equals("blocks round-tripped through reclaimed slots", verified, pool * trials)
    out.seconds = time.monotonic() - started
    return out


def _stream_then_kill(
    address: str, block_len: int, pool: int, min_stored: int, out: Outcome
) -> float | None:
    """Start a streaming client, SIGKILL it mid-stream; the kill time, or ``None`` on trouble."""
    cmd = [sys.executable, "-m", "torch_kv_tier.benchmarks.reliability_client", address]
    cmd += ["--block-len", str(block_len)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        reader = LineReader(child.stdout)
        line = reader.next_line(60)
        if line != f"connected {pool}":
            out.problem(f"the client did not lease the whole pool: {line!r}")
            return None
        while True:
            line = reader.next_line(60)
            if line is None or not line.startswith("stored "):
                out.problem(f"the client stopped streaming: {line!r}")
                return None
            if int(line.split()[1]) >= min_stored:
                break
        child.kill()
        return time.monotonic()
    except TimeoutError as exc:
        out.problem(f"the client went silent: {exc}")
        return None
    finally:
        kill_process(child)


def _reuse_whole_pool(
    address: str, block_len: int, pool: int, killed_at: float, held_s: float, out: Outcome
) -> tuple[float, int] | None:
    """Connect a new tier asking for the whole pool until granted (the dead client's lease is
    held for ``held_s``); write and read back a block in every slot. Returns (seconds from the
    kill to the grant, blocks verified)."""
    with TierManager.create(pool, block_len, name="after-client-death") as tier:
        deadline = killed_at + held_s + 10.0
        while True:
            try:
                peer = tier.connect(address, private=True, slots=pool)
                break
            except HandshakeRejected as exc:
                if not exc.reason.startswith("no free slots") or time.monotonic() > deadline:
                    out.problem(f"the dead client's lease was not reclaimed: {exc.reason}")
                    return None
                time.sleep(0.02)
        granted = time.monotonic() - killed_at
        capacity = tier.stats().peers[peer].capacity
        if capacity != pool:
            out.problem(f"the new client got {capacity} of {pool} slots")
            return None
        tier.arena.tensor.copy_(random_blocks(pool, block_len, seed=int(granted * 1e6)))
        original = tier.arena.tensor.clone()
        keys = [f"after-{i}" for i in range(pool)]
        stored = tier.store(keys, range(pool)).result(timeout=30)
        tier.arena.tensor.zero_()
        loaded = tier.load(keys, range(pool)).result(timeout=30)
        if not (stored.ok and loaded.ok):
            out.problem(
                f"round trip through reclaimed slots failed: {stored.failed or loaded.failed}"
            )
        same = int((tier.arena.tensor == original).all(dim=1).sum())
        return granted, same


def close_under_load(
    transfers: int = 400, *, timeout_s: float = 1.0, block_len: int = 4096, slack_s: float = 1.0
) -> Outcome:
    """``transfers`` single-block writes in flight to a stopped server (UCX over TCP), then
    ``close(timeout_s)``: it must return within ``timeout_s + slack_s`` and resolve every
    future with "closed"."""
    out = Outcome(
        "close under load",
        {"transfers": transfers, "timeout_s": timeout_s, "transport": "UCX tcp"},
    )
    started = time.monotonic()
    with ucx_over_tcp():
        server = ServerProcess.start(2 * transfers, block_len, env=TCP_ENV)
        tier = TierManager.create(
            transfers + 1, block_len, name="close", max_inflight=2 * transfers
        )
        try:
            # private: hundreds of writes go out at once (shared, they would wait for grants)
            tier.connect(server.address, private=True)
            warm = tier.store(["warm"], [0]).result(timeout=30)  # UCX wire-up done
            if not warm.ok:
                out.problem(f"warm-up store failed: {warm.failed}")
            stop_process(server.proc.pid)
            futures = [tier.store([f"k{i}"], [i + 1]) for i in range(transfers)]
            inflight = tier.stats().inflight
            t0 = time.monotonic()
            tier.close(timeout=timeout_s)
            took = time.monotonic() - t0
        finally:
            tier.close()
            server.kill()
    unresolved = sum(not f.done() for f in futures)
    reasons = Counter(r for f in futures if f.done() for r in f.result().failed.values())
    if set(reasons) - {"closed"}:
        out.problem(f"futures failed with other reasons than 'closed': {dict(reasons)}")
    out.at_least("transfers in flight at close", inflight, transfers // 2)
    out.at_most("close() duration", round(took, 3), timeout_s + slack_s, "s")
    out.equals("futures unresolved after close()", unresolved, 0)
    out.seconds = time.monotonic() - started
    return out


__all__ = ["client_death", "close_under_load"]
