"""A tier process of ``torch-kv-tier chaos`` (``chaos``): writer or reader rounds against every
host, every loaded block checked, every future bounded, probes of staleness answered.

A key's block is a pure function of its number (``reliability_concurrency.make_block``), so a
reader checks any block it loads. A worker connects to every host it does not list as a peer
(at most once per ``REDIAL_S`` per host: hosts are killed and restarted under it), and between
rounds it answers the orchestrator's probes: "host H stored key K". A probe is *seen* once
``lookup([K])``; *dropped* once no peer of the worker is on H, or once the orchestrator says
it restarts H (a new H is empty: a tier that dialled it again in the middle of one round
lists H and rightly never sees K); *stale* when none of these happened within
``STALE_BOUND_S`` (the tier lists H but never learnt of K). The orchestrator queues a
restart's notice before its SIGKILL, and a worker reads its queue again after looking its
probes up, so a lookup that the restart could have emptied is never judged without the notice.

A worker also feeds the public API keys the wire cannot carry (an int ``>= 2**64``, a 100 kB
``bytes`` key): raising ``ValueError``/``TypeError`` at the call is fine, a future that settles
is fine; the rest of the run shows whether it cost the tier its host.

It sends ``("ready", name, None)`` once connected, then ``("done", name, counts)`` once its
command queue says stop (``None``) or ``seconds`` passed (or ``("error", name, traceback)``).
Single-threaded; every future is awaited with ``FUTURE_BOUND_S``, past which it counts as hung.
"""

from __future__ import annotations

import logging
import queue
import random
import time
import traceback
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torch_kv_tier.benchmarks.reliability_concurrency import make_block

FUTURE_BOUND_S = 30.0  # a store/load future: heartbeat timeout (10 s) plus a margin
STALE_BOUND_S = 15.0  # a probe: a listed host's key must be seen (or the host dropped) by then
REDIAL_S = 1.0  # least time between two connects to one host
BLOCK_LEN = 4096
BAD_KEYS: tuple[Any, ...] = (1 << 64, b"k" * 100_000)


@dataclass
class WorkerCounts:
    """One worker's figures (summed over workers by the orchestrator)."""

    stored: int = 0  # keys a store reported ok
    verified: int = 0  # loaded blocks equal to their key's block
    wrong: int = 0  # loaded ok, but not their key's block
    settled: int = 0  # futures that settled within FUTURE_BOUND_S
    hung: int = 0  # futures that did not
    bad_raised: int = 0  # bad keys refused at the call (ValueError/TypeError)
    bad_settled: int = 0  # bad keys whose future settled
    probes_seen: int = 0
    probes_dropped: int = 0  # no peer of the worker on the host
    probes_restarted: int = 0  # the host restarted first
    probes_stale: int = 0
    connects: int = 0
    connect_failures: int = 0
    peers_dropped: int = 0  # hosts the tier dropped (a restart, a reset, a long freeze)
    raised: int = 0  # calls that raised something else than a bad key's ValueError/TypeError
    raised_samples: list[str] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # failed keys by reason


def _on(peer_id: str, prefix: str) -> bool:
    """``peer_id`` names a session of host ``prefix`` (``HOST:PORT[/instance]``)."""
    return peer_id == prefix or peer_id.startswith(prefix + "/")


class _Worker:
    def __init__(
        self, tier: Any, addresses: list[str], keys: int, seed: str, commands: Any
    ) -> None:
        self.tier = tier
        self.commands = commands
        self.stopping = False
        self.addresses = addresses
        self.keys = keys
        self.rng = random.Random(seed)
        self.counts = WorkerCounts()
        self.failures: Counter[str] = Counter()
        self.dialed: dict[str, float] = {}
        self.probes: list[tuple[str, Any, float, int]] = []  # (host, key, deadline, restarts)
        self.restarts: Counter[str] = Counter()  # restart notices by host

    def redial(self) -> None:
        """Connect to every host no peer is on (rate-limited per host)."""
        peers = self.tier.peers()
        for address in self.addresses:
            listed = any(_on(p, address) for p in peers)
            if listed or time.monotonic() - self.dialed.get(address, -REDIAL_S) < REDIAL_S:
                continue
            self.dialed[address] = time.monotonic()
            try:
                self.tier.connect(address, timeout_s=2.0)
                self.counts.connects += 1
            except Exception:  # host down, stopped or restarting: next time
                self.counts.connect_failures += 1

    def settle(self, future: Future[Any]) -> Any:
        try:
            result = future.result(timeout=FUTURE_BOUND_S)
        except FutureTimeout:
            self.counts.hung += 1
            return None
        self.counts.settled += 1
        self.failures.update(result.failed.values())
        return result

    def write_round(self) -> None:
        numbers = self.rng.sample(range(self.keys), self.rng.randint(1, self.tier.arena.num_blocks))
        self.tier.arena.tensor.numpy()[: len(numbers)] = [
            make_block(n, n, BLOCK_LEN) for n in numbers
        ]
        result = self.settle(self.tier.store(numbers, range(len(numbers))))
        if result is not None:
            self.counts.stored += len(result.keys)

    def read_round(self) -> None:
        want = self.rng.randint(1, self.tier.arena.num_blocks)
        numbers = [n for n in self.rng.sample(range(self.keys), 4 * want) if self.tier.contains(n)]
        numbers = numbers[:want]
        if not numbers:
            return
        arena = self.tier.arena.tensor.numpy()
        arena[: len(numbers)] = 0  # a load that writes nothing cannot pass for a good one
        result = self.settle(self.tier.load(numbers, range(len(numbers))))
        if result is None:
            return
        loaded = set(result.keys)
        for i, n in enumerate(numbers):
            if n in loaded:
                good = np.array_equal(arena[i], make_block(n, n, BLOCK_LEN))
                self.counts.verified += good
                self.counts.wrong += not good

    def bad_key(self) -> None:
        key = self.rng.choice(BAD_KEYS)
        try:
            future = self.tier.store([key], [0])
        except (ValueError, TypeError):
            self.counts.bad_raised += 1
            return
        if self.settle(future) is not None:
            self.counts.bad_settled += 1

    def take_commands(self) -> bool:
        """Queue the probes and count the restarts sent since the last call; ``False`` once
        told to stop."""
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return not self.stopping
            if command is None:
                self.stopping = True
            elif command[0] == "restart":
                self.restarts[command[1]] += 1
            else:
                _, host, key = command
                deadline = time.monotonic() + STALE_BOUND_S
                self.probes.append((host, key, deadline, self.restarts[host]))

    def check_probes(self) -> None:
        peers = self.tier.peers()
        unseen = []  # (probe, overdue)
        for probe in self.probes:
            host, key, deadline, _ = probe
            if self.tier.lookup([key]):  # in DRAM or on the host's disk
                self.counts.probes_seen += 1
            elif not any(_on(p, host) for p in peers):
                self.counts.probes_dropped += 1
            else:
                unseen.append((probe, time.monotonic() > deadline))
        self.probes = []
        self.take_commands()  # the notice of a restart that emptied a host came before it
        for probe, overdue in unseen:
            host, key, _, restarts = probe
            if self.restarts[host] != restarts:
                self.counts.probes_restarted += 1
            elif overdue:
                self.counts.probes_stale += 1
                logging.getLogger(__name__).error("stale: %s lists %s, no %r", peers, host, key)
            else:
                self.probes.append(probe)


def worker(
    role: str,
    name: str,
    addresses: list[str],
    keys: int,
    seconds: float,
    pause_s: float,
    commands: Any,
    results: Any,
) -> None:
    """A child process (module docstring): ``role`` is ``"writer"`` or ``"reader"``."""
    logging.basicConfig(level=logging.ERROR, format=f"%(asctime)s {name} %(message)s")
    from torch_kv_tier.manager import TierManager

    try:
        with TierManager.create(16, BLOCK_LEN, name=name, grant_batch=64) as tier:
            w = _Worker(tier, addresses, keys, name, commands)
            w.redial()
            results.put(("ready", name, None))
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and w.take_commands():
                w.redial()
                w.check_probes()
                try:
                    if w.rng.random() < 0.02:
                        w.bad_key()
                    elif role == "writer":
                        w.write_round()
                    else:
                        w.read_round()
                except Exception as exc:  # a broken promise of the API: counted, and go on
                    w.counts.raised += 1
                    if len(w.counts.raised_samples) < 3:
                        w.counts.raised_samples.append(traceback.format_exc(limit=-3))
                    logging.getLogger(__name__).error("%s raised %r", role, exc)
                time.sleep(pause_s)
            w.counts.failures = dict(w.failures)
            w.counts.peers_dropped = w.tier.stats().peers_dropped
            results.put(("done", name, w.counts))
    except BaseException:
        results.put(("error", name, traceback.format_exc()))
