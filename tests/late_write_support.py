"""An in-process transport whose writes land when a test says so (``LateWriteTransport``, no
NIXL needed), and a tier over it with peers of its own (``late_write_tier``), for the tests of
the manager's failure model; ``BLOCK``: the block length their arenas use."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.transport.base import CancelMode, DataTransport, PollResult

BLOCK = 64


class LateWriteTransport(DataTransport):
    """Peers are tensors in this process. While ``hold`` is set, writes stay in flight until
    ``land(tid)`` copies them; a peer given to ``fault`` is reported faulted, and a write to it
    stays in flight (vLLM 0.33's model: a failed state check does not prove it stopped)."""

    def __init__(self, region: torch.Tensor) -> None:
        super().__init__(region)
        self.remotes: dict[bytes, torch.Tensor] = {}  # agent metadata -> that peer's memory
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._peers: dict[str, torch.Tensor] = {}
        self._pending: dict[int, tuple[str, torch.Tensor, list[int], list[int]]] = {}
        self._done: dict[int, str] = {}
        self._faults: dict[str, str] = {}
        self._failed: dict[int, str] = {}
        self.hold = False
        self.refuse_next = False  # the next write is sent, then refused: it lands on ``land``
        self._ended: set[int] = set()  # reported failed or refused, yet still to land

    def get_agent_metadata(self) -> bytes:
        return b"local"

    def add_remote_peer(
        self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int
    ) -> None:
        with self._lock:
            self._peers[peer_id] = self.remotes[agent_metadata]

    def remove_remote_peer(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)
            self._faults.pop(peer_id, None)

    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        with self._lock:
            tid = next(self._ids)
            self._pending[tid] = (
                peer_id,
                self._peers[peer_id],
                list(local_idxs),
                list(remote_idxs),
            )
        if self.refuse_next:  # NIXL freed what it sent: never reported
            self.refuse_next = False
            self._ended.add(tid)
            return None
        if not self.hold:
            self.land(tid)
        return tid

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        with self._lock:
            tid = next(self._ids)
            region = self.region.owner
            region[list(local_idxs)] = self._peers[peer_id][list(remote_idxs)]
            self._done[tid] = peer_id
        return tid

    def land(self, tid: int) -> None:
        with self._lock:
            peer_id, remote, local, dest = self._pending.pop(tid)
            remote[dest] = self.region.owner[local]
            if tid not in self._ended:
                self._done[tid] = peer_id

    def fail(self, tid: int) -> None:
        """Report ``tid`` failed while it stays in flight (it lands on ``land``, unreported)."""
        with self._lock:
            self._failed[tid] = self._pending[tid][0]

    def fault(self, peer_id: str, cause: str) -> None:
        with self._lock:
            self._faults[peer_id] = cause

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._pending)

    def poll(self, peer_id: str | None = None) -> PollResult:
        with self._lock:
            done = [t for t, p in self._done.items() if peer_id in (None, p)]
            failed = [t for t, p in self._failed.items() if peer_id in (None, p)]
            for tid in done:
                del self._done[tid]
            for tid in failed:
                del self._failed[tid]
                self._ended.add(tid)
            return PollResult(done, failed, self._faults.get(peer_id) if peer_id else None)

    def faulted_peers(self) -> dict[str, str]:
        with self._lock:
            return dict(self._faults)

    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> list[int]:
        with self._lock:
            for tid in transfer_ids:
                self._pending.pop(tid, None)
        return []

    def close(self) -> None:
        pass


@contextmanager
def late_write_tier(
    arena: BlockArena, peers: dict[str, int], **settings: Any
) -> Iterator[tuple[TierManager, LateWriteTransport]]:
    """A tier over ``arena`` and a ``LateWriteTransport`` of it, with one peer per ``peers``
    item: its id, and its number of zeroed slots (its agent metadata is its id, encoded).
    ``settings`` go to ``TierManager``. The tier is closed on exit, a failing test's too."""
    transport = LateWriteTransport(arena.tensor)
    tier = TierManager(arena, transport, **settings)
    try:
        for peer_id, slots in peers.items():
            transport.remotes[peer_id.encode()] = torch.zeros(
                slots, arena.block_len, dtype=torch.uint8
            )
            tier.add_peer(peer_id, peer_id.encode(), 0, slots, arena.block_len)
        yield tier, transport
    finally:
        tier.close()
