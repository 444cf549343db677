"""What the tests of a tier's own races share: a tier whose transport (``LateWriteTransport``) and
host sessions (``SharedSession``, ``PrivateSession``) are in this process, and hosts added to it
with or without slots granted."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from late_write_support import LateWriteTransport, late_write_tier
from remote_support import BLOCK_LEN

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.shared_host import SharedHost

RESULT_TIMEOUT_S = 10.0


class SharedSession:
    """What a tier uses of a shared ``RemoteSession``; grant requests wait in ``grants`` until
    the test answers them."""

    def __init__(self, peer_id: str, max_granted: int) -> None:
        self.peer_id, self.address, self.session_id = peer_id, f"{peer_id}:1", f"sid-{peer_id}"
        self.shared, self.max_granted, self.lost = True, max_granted, None
        self.agent_metadata, self.base_addr, self.num_blocks, self.block_len = b"", 0, 8, BLOCK_LEN
        self.grants: list[Any] = []
        self.promoted: list[Any] = []
        self.closed: list[bool] = []
        self.ended_clean = False

    def grant(self, want: int, on_answer: Any, *, with_commits: bool = False) -> None:
        self.grants.append(on_answer)

    def answer(self, slots: list[int]) -> None:
        future: Future[p.ServerMessage] = Future()
        future.set_result(p.Granted(1, slots))
        self.grants.pop(0)(future)

    def promote(self, keys: list[Any]) -> None:
        self.promoted += keys

    def close(self, *, clean: bool = True) -> None:
        self.closed.append(clean)

    def commit(self, *args: Any) -> None: ...
    def touch(self, *args: Any) -> None: ...
    def follow(self, *args: Any) -> None: ...
    def send_batched(self) -> None: ...
    def report_usage(self, **kwargs: Any) -> None: ...
    def release(self, *args: Any) -> None: ...
    def unsent_commits(self) -> list[Any]:
        return []

    def unreleased(self) -> list[str]:
        return []


@contextmanager
def in_process_tier(max_inflight: int = 64) -> Iterator[tuple[TierManager, LateWriteTransport]]:
    """A tier whose writes stay in flight until landed, and a private peer ``r0``'s memory
    (8 slots; not added), closed on exit, a failing test's too."""
    arena = BlockArena(16, BLOCK_LEN)
    with late_write_tier(arena, {}, max_inflight=max_inflight) as (tier, transport):
        transport.remotes[b"r0"] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
        transport.hold = True
        yield tier, transport


def add_shared_host(tier: TierManager, max_granted: int) -> tuple[SharedHost, SharedSession]:
    """A shared host ``h`` (8 slots) published as ``_join_shared`` does, without a network."""
    assert isinstance(tier.transport, LateWriteTransport)
    tier.transport.remotes[b"h"] = torch.zeros(8, BLOCK_LEN, dtype=torch.uint8)
    tier.transport.add_remote_peer("h", b"h", 0, 8, BLOCK_LEN)
    session = SharedSession("h", max_granted)
    with tier._lock:
        slots = tier._index.add_shared_peer("h", 8)
        host = tier._peers["h"] = SharedHost(slots, session, max_granted)
    return host, session


class PrivateSession(SharedSession):
    """A private lease's session as ``_connect`` uses it."""

    def __init__(self) -> None:
        super().__init__("host-1", 0)
        self.shared, self.lease = False, range(8)
