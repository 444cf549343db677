"""``torch_kv_tier``: the full tier (logical keys, slot placement, background completion).

Driven as a user drives it: ``TierManager.create(...)``, ``connect(address)``, then ``store``/
``load`` with logical keys and Python lists of local slots, completions observed through the
returned futures. The driver charges it what it charges ``nixl_raw``: ``reap`` checks each
outstanding call once (``future.done()`` here, ``check_xfer_state`` there), stamps the ones done
with the time it saw them, and yields the core when none was. Writes store fresh keys every call,
so the lease fills and the tier evicts its least recently used keys as it would in service;
reads load a stored key set. ``torch_kv_tier_2hosts``/``_4hosts`` spread the same lease over 2 or
4 remote hosts (placement and one transfer per host per call), each host leasing 1.5 x its even
share of the working set (keys do not split evenly).

``torch_kv_tier_noverify`` is the same tier with ``verify=False`` (``TierManager``'s option for
private peers): its stores compute no digests and its loads check none. Set beside
``torch_kv_tier`` (the default, ``verify=True``), it prices verification.

``torch_kv_tier_staged`` (CUDA only) keeps the source blocks on the GPU and stages them through
the tier's pinned host arena: a D2H copy before each store, an H2D copy after each load.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Hashable
from concurrent.futures import Future
from typing import Any

import torch

from torch_kv_tier.benchmarks.core import Call, Op, Skip, System, TransferFailed, runs
from torch_kv_tier.benchmarks.remote import Target
from torch_kv_tier.benchmarks.system_nixl_raw import local_arena


class Tier(System):
    """A ``TierManager`` over its own arena, connected to the target's remote host(s).

    By default it leases a private range of each host (``connect(private=True, slots=...)``);
    ``shared=True`` joins each host's shared pool instead (``connect(address)``). ``hosts``
    overrides the class's host count; ``verify`` (the tier's digests, default on) the class's.
    """

    name = "torch_kv_tier"
    remote_layout = "system"
    hosts = 1
    verify = True

    def __init__(
        self,
        target: Target,
        *,
        arena_device: str | None = None,
        hosts: int | None = None,
        shared: bool = False,
        verify: bool | None = None,
    ) -> None:
        from torch_kv_tier.manager import TierManager
        from torch_kv_tier.remote.client import HandshakeRejected

        self.hosts = hosts or self.hosts
        self.verify = self.verify if verify is None else verify
        addresses = [target.require_address(), *target.more_addresses][: self.hosts]
        if len(addresses) < self.hosts:
            raise Skip(f"needs {self.hosts} remote hosts, this point has {len(addresses)}")
        device = arena_device or target.device
        self._tm: Any = TierManager.create(
            target.local_slots,
            target.block_len,
            device=device,
            name="bench-tier",
            verify=self.verify,
        )
        try:
            # The working set plus the target's slack (calls in flight complete out of order);
            # over several hosts 1.5 x each host's even share: placement spreads keys unevenly.
            want = target.remote_slots + target.slack_slots
            share = -(-3 * want // (2 * self.hosts)) if self.hosts > 1 else want
            for address in addresses:
                if shared:
                    self._tm.connect(address, token=target.token)
                else:
                    self._tm.connect(address, token=target.token, private=True, slots=share)
            capacity = sum(p.capacity for p in self._tm.stats().peers.values())
            # The plan's size: the working set, or less when the host granted a shorter lease.
            self.remote_slots = min(target.remote_slots, capacity)
        except HandshakeRejected as exc:
            self._tm.close()
            raise Skip(f"remote host refused: {exc}") from exc
        except BaseException:
            self._tm.close()
            raise
        self.local = self._tm.arena.tensor
        self.path = "vram" if self.local.is_cuda else "host"
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)

    def submit(self, op: Op, call: Call) -> Hashable:
        tid = next(self._ids)
        if op == "write":
            self._pending[tid] = self._tm.store(call.keys, call.local_list)
        else:
            self._pending[tid] = self._tm.load(call.keys, call.local_list)
        return tid

    def reap(self, timeout: float) -> list[tuple[Hashable, float]]:
        out: list[tuple[Hashable, float]] = []
        for tid, future in list(self._pending.items()):
            if future.done():
                out.append((tid, time.perf_counter()))
                del self._pending[tid]
                result = future.result()
                if not result.ok:
                    reasons = sorted(set(result.failed.values()))
                    raise TransferFailed(f"{len(result.failed)} keys failed: {', '.join(reasons)}")
        if not out:
            os.sched_yield()  # as nixl_raw does: the tier's poller gets the core (and the GIL)
        return out

    def moved(self, op: Op) -> int:
        """The bytes the tier's own counters (``TierStats.bytes_stored`` for writes,
        ``bytes_loaded`` for reads) say it has moved so far: a store of a key already stored
        sends nothing, and counts nothing."""
        stats = self._tm.stats()
        return stats.bytes_stored if op == "write" else stats.bytes_loaded

    def close(self) -> None:
        self._tm.close()


class TierNoVerify(Tier):
    """The tier with ``verify=False``: no digests on its private lease's stores and loads."""

    name = "torch_kv_tier_noverify"
    verify = False


class TierOver2Hosts(Tier):
    name = "torch_kv_tier_2hosts"
    hosts = 2


class TierOver4Hosts(Tier):
    name = "torch_kv_tier_4hosts"
    hosts = 4


class StagedTier(Tier):
    """The tier over pinned host memory, fed from (and feeding) a GPU arena by copies."""

    name = "torch_kv_tier_staged"

    def __init__(self, target: Target) -> None:
        if not target.device.startswith("cuda"):
            raise Skip("the staged path needs --device cuda")
        super().__init__(target, arena_device="cpu")
        self._host = self.local
        if not self._host.is_pinned():
            self.close()
            raise Skip("the tier's host arena is not pinned, so staging would not be async")
        self.local = local_arena(target, pinned=False)
        self.path = "staged"
        self._stream = torch.cuda.Stream(self.local.device)
        self._loads: dict[Hashable, Call] = {}

    def _copy(self, call: Call, to_host: bool) -> None:
        with torch.cuda.stream(self._stream):
            for lo, _, n in runs(call.local, call.local):
                gpu, host = self.local[lo : lo + n], self._host[lo : lo + n]
                (host if to_host else gpu).copy_(gpu if to_host else host, non_blocking=True)
        self._stream.synchronize()

    def submit(self, op: Op, call: Call) -> Hashable:
        if op == "write":
            self._copy(call, to_host=True)
            return super().submit(op, call)
        tid = super().submit(op, call)
        self._loads[tid] = call
        return tid

    def reap(self, timeout: float) -> list[tuple[Hashable, float]]:
        out = []
        for tid, t_done in super().reap(timeout):
            call = self._loads.pop(tid, None)
            if call is not None:
                self._copy(call, to_host=False)
                t_done = time.perf_counter()
            out.append((tid, t_done))
        return out
