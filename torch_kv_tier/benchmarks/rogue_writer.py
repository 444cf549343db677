"""A rogue writer that no fence can stop: raw NIXL writes of garbage into every slot of a host
while a tier stores and loads keys there (issue 17, "reads that verify their bytes").

The rogue is its own process (``spawn``): a ``NixlTransport`` over a region of random bytes,
a shared session of the host (which hands out the agent metadata of the whole pool, as the
README's isolation section says any client gets) and a loop that writes its region over every
slot of the pool, one sweep after another, until told to stop. It goes through no tier, no
grant and no lease: only a check of the bytes a load brought can catch it.

Meanwhile a tier in this process (a private lease, or the shared pool) stores rounds of fresh
keys and loads them back. What must hold: every load the tier reports ``ok`` brought exactly
its key's block; the others failed (``"missing"``); every future settles within its bound;
and once the rogue stopped, fresh keys round-trip ``ok`` and byte-correct again.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.frozen_writer_b import block_of
from torch_kv_tier.benchmarks.reliability_common import Outcome
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

RESULT_TIMEOUT_S = 30.0  # one store/load future
ROGUE_START_S = 120.0  # the rogue imports torch and NIXL and connects (2 busy cores: slow)
SWEEP_PAUSE_S = 0.0005  # between two sweeps over the pool: a rogue, but not a core hog
FILL = 0x5A  # the tier's blocks: this byte, with the key's number in front


def _rogue(address: str, num_blocks: int, block_len: int, stop: Any, results: Any) -> None:
    """The rogue process: sweep garbage over every slot of the host (``num_blocks`` of them)
    until ``stop`` is set; sends ``("ready", None)``, then ``("done", sweeps)`` or
    ``("error", text)``."""
    import torch

    from torch_kv_tier.remote import Region, RemoteSession
    from torch_kv_tier.transport import NixlTransport

    try:
        garbage = torch.randint(0, 256, (num_blocks, block_len), dtype=torch.uint8)
        transport = NixlTransport("rogue", garbage)
        session = RemoteSession.open(
            address,
            agent_metadata=transport.get_agent_metadata(),
            region=Region(transport.base_addr, num_blocks, block_len),
        )
        transport.add_remote_peer(
            "host", session.agent_metadata, session.base_addr, num_blocks, session.block_len
        )
        results.put(("ready", None))
        sweeps = 0
        slots = list(range(num_blocks))
        while not stop.is_set():
            tid = transport.write_blocks("host", slots, slots)
            deadline = time.monotonic() + RESULT_TIMEOUT_S
            while time.monotonic() < deadline:
                result = transport.poll()
                if tid in result.failed:
                    raise RuntimeError("a rogue write failed")
                if tid in result.done:
                    break
            sweeps += 1
            slots = slots[1:] + slots[:1]  # another block of garbage over each slot next time
            time.sleep(SWEEP_PAUSE_S)
        session.close()
        transport.close()
        results.put(("done", sweeps))
    except BaseException as exc:
        results.put(("error", repr(exc)))


def rogue_writer(
    *, private: bool, seconds: float = 3.0, num_blocks: int = 64, block_len: int = 4096
) -> Outcome:
    """Run the scenario (module docstring) on a host of ``2 * num_blocks`` slots."""
    out = Outcome(
        "rogue writer",
        {"pool": "private lease" if private else "shared pool", "seconds": seconds},
    )
    started = time.monotonic()
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    with ServerProcess.start(2 * num_blocks, block_len) as host:
        rogue = ctx.Process(
            target=_rogue,
            args=(host.address, 2 * num_blocks, block_len, stop, results),
            daemon=True,
        )
        rogue.start()
        try:
            with TierManager.create(2 * num_blocks, block_len, name="rogue-victim") as tier:
                if private:
                    tier.connect(host.address, private=True, slots=num_blocks)
                else:
                    tier.connect(host.address)
                what, payload = _message(results, ROGUE_START_S)
                if what != "ready":
                    out.problem(f"the rogue did not start: {payload}")
                    return out
                counts = _rounds(tier, num_blocks, seconds, 0, out)
                stop.set()
                what, payload = _message(results, RESULT_TIMEOUT_S)
                if what == "done":
                    out.at_least("rogue sweeps over the whole pool", payload, 1)
                else:
                    out.problem(f"the rogue failed: {payload}")
                rogue.join(timeout=10)
                after = _rounds(tier, num_blocks, 0.0, 1_000_000, out)
        finally:
            if rogue.is_alive():
                rogue.kill()
                rogue.join(timeout=10)
    out.equals("wrong blocks loaded ok while the rogue wrote", counts["wrong"], 0)
    out.info("blocks verified while the rogue wrote", counts["verified"])
    for reason, n in sorted((k, v) for k, v in counts.items() if k not in ("wrong", "verified")):
        out.info(f"loads failed while the rogue wrote: {reason}", n)
    out.equals("wrong blocks loaded ok after the rogue stopped", after["wrong"], 0)
    out.equals("blocks verified after the rogue stopped", after["verified"], num_blocks // 2)
    out.seconds = time.monotonic() - started
    return out


def _message(results: Any, timeout_s: float) -> tuple[str, Any]:
    """The rogue's next message, or ``("silent", ...)`` after ``timeout_s``."""
    try:
        what, payload = results.get(timeout=timeout_s)
    except queue.Empty:
        return "silent", f"nothing from the rogue within {timeout_s:.0f} s"
    return str(what), payload


def _rounds(
    tier: TierManager, num_blocks: int, seconds: float, first: int, out: Outcome
) -> Counter[str]:
    """Store and load rounds of ``num_blocks // 2`` fresh keys (numbers from ``first``) for
    ``seconds`` (at least one round): ``verified``, ``wrong`` and each failure reason."""
    counts: Counter[str] = Counter()
    arena = tier.arena.tensor.numpy()
    half = num_blocks // 2
    deadline = time.monotonic() + seconds
    number = first
    while True:
        numbers = list(range(number, number + half))
        number += half
        for i, n in enumerate(numbers):
            arena[i] = block_of(n, FILL, tier.arena.block_len)
        keys = [f"k{n}" for n in numbers]
        try:
            stored = tier.store(keys, range(half)).result(timeout=RESULT_TIMEOUT_S)
            arena[half : 2 * half] = 0  # a load that writes nothing cannot pass for a good one
            loaded = tier.load(keys, range(half, 2 * half)).result(timeout=RESULT_TIMEOUT_S)
        except FutureTimeout:
            out.problem(f"a future did not settle within {RESULT_TIMEOUT_S:.0f} s")
            return counts
        counts.update(f"store {reason}" for reason in stored.failed.values())
        counts.update(loaded.failed.values())
        ok = set(loaded.keys)
        for i, (key, n) in enumerate(zip(keys, numbers)):
            if key in ok:
                good = np.array_equal(arena[half + i], block_of(n, FILL, tier.arena.block_len))
                counts["verified" if good else "wrong"] += 1
        if time.monotonic() >= deadline:
            return counts


__all__ = ["rogue_writer"]
