"""``nixl_raw``: a bare ``nixl_agent`` initiator loop, the floor under the tier.

One registration of the local arena, descriptor lists prepared once for both sides, then per
call ``make_prepped_xfer`` + ``transfer`` on pre-built int32 index arrays, and a busy loop of
``check_xfer_state`` over the outstanding handles, against the same remote host, with the remote
slots laid out as the tier lays them out (contiguous runs): whatever the tier adds on top is its
own overhead.

The agent is configured as the tier's transport configures its own (UCX, no progress thread, no
worker threads), except for NIXL's sync mode: this loop is one thread, so it keeps NIXL's
default (NONE, NIXL's locks compiled away), as a user of bare NIXL would. The tier runs RW
because its poller thread and its callers share one agent; those locks are part of what the
tier adds, so the floor leaves them out on purpose.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from torch_kv_tier.benchmarks.core import Call, Op, Skip, System, TransferFailed
from torch_kv_tier.benchmarks.remote import Target, open_session

_NUM_THREADS = 0  # NixlTransport's default


def _descs(base_addr: int, num_blocks: int, block_len: int, device_id: int) -> np.ndarray:
    descs = np.empty((num_blocks, 3), dtype=np.int64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.int64) * block_len
    descs[:, 1] = block_len
    descs[:, 2] = device_id
    return descs


def local_arena(target: Target, *, pinned: bool) -> torch.Tensor:
    """A zeroed ``[local_slots, block_len]`` uint8 arena on the target device."""
    shape = (target.local_slots, target.block_len)
    if target.device.startswith("cuda"):
        return torch.zeros(shape, dtype=torch.uint8, device=target.device)
    tensor = torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)
    return tensor.zero_()


class BareNixl:
    """A NIXL initiator over ``arena`` connected to the remote host of ``target``.

    Its remote descriptor list covers the host's whole pool; ``post`` takes absolute slots, of
    which ``remote_base .. remote_base + remote_slots - 1`` are this agent's lease.
    Single-threaded: the caller owns the agent.
    """

    def __init__(self, name: str, arena: torch.Tensor, target: Target) -> None:
        """Register ``arena`` (a 2-D ``[blocks, block_len]`` tensor) and open a session with
        ``target``'s host. On any failure, what was made (the agent, its registration, descriptor
        lists, the session) is released before the error propagates."""
        from torch_kv_tier.transport.ucx_env import apply_ucx_policy

        if arena.dim() != 2:
            raise ValueError(f"arena must be [blocks, block_len], got shape {tuple(arena.shape)}")
        apply_ucx_policy()
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise Skip(f"nixl not importable ({exc}); pip install nixl") from exc
        self.arena = arena
        self._reg: Any = None
        self._local: Any = None
        self._session: Any = None
        self._remote: Any = None
        self._peer = ""
        self._agent: Any = nixl_agent(
            f"{name}-{uuid.uuid4().hex[:12]}",
            nixl_agent_config(enable_prog_thread=False, num_threads=_NUM_THREADS),
        )
        mem_type = "VRAM" if arena.is_cuda else "DRAM"
        device_id = (arena.device.index or 0) if arena.is_cuda else 0
        num_blocks, block_len = arena.shape
        base = arena.data_ptr()
        try:
            self._reg = self._agent.register_memory(
                [(base, arena.numel(), device_id, "")], mem_type=mem_type
            )
            self._local = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                _descs(base, num_blocks, block_len, device_id),
                mem_type=mem_type,
            )
            self._session = open_session(
                target, bytes(self._agent.get_agent_metadata()), base, num_blocks, mem_type
            )
            s = self._session
            self._peer = self._agent.add_remote_agent(s.agent_metadata)
            self._remote = self._agent.prep_xfer_dlist(
                self._peer, _descs(s.base_addr, s.num_blocks, block_len, 0), mem_type="DRAM"
            )
        except BaseException:
            self.close()
            raise
        self.remote_base = s.lease.start
        self.remote_slots = len(s.lease)

    def post(self, op: Op, local: np.ndarray | list[int], remote: np.ndarray | list[int]) -> Any:
        """Make and post one transfer; returns its handle."""
        handle = self._agent.make_prepped_xfer(
            "WRITE" if op == "write" else "READ",
            self._local,
            local,
            self._remote,
            remote,
        )
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferFailed(f"NIXL refused to post a {op}")
        return handle

    def done(self, handle: Any) -> bool:
        """True once ``handle`` completed (and released); raises ``TransferFailed`` on error."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            raise TransferFailed(f"NIXL transfer failed: {exc}") from exc
        if state == "PROC":
            return False
        self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransferFailed(f"NIXL transfer ended in state {state}")
        return True

    def release(self, handle: Any) -> None:
        """Drop an unfinished handle (teardown after a failure)."""
        if self._agent is not None:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # already gone with its peer
                return

    def close(self) -> None:
        """Release handles, registration and the session (each step even if another fails),
        then the agent: every handle references it, so all are dropped and the agent goes now,
        on this thread, not later by the collector. Safe on a part-built instance."""
        if self._agent is None:
            return
        agent, self._agent = self._agent, None
        steps = [
            lambda: self._remote is not None and agent.release_dlist_handle(self._remote),
            lambda: self._peer and agent.remove_remote_agent(self._peer),
            lambda: self._local is not None and agent.release_dlist_handle(self._local),
            lambda: self._reg is not None and agent.deregister_memory(self._reg),
            lambda: self._session is not None and self._session.close(),
        ]
        for step in steps:
            try:
                step()
            except Exception:  # teardown goes on; the process exits soon after
                continue
        self._remote = self._local = self._reg = None


class NixlRaw(System):
    """The ``nixl_raw`` system: ``BareNixl`` driven by a busy ``check_xfer_state`` loop.

    ``arena`` reuses an existing local arena (the read-back verifier of a write-only system);
    by default the system allocates its own.
    """

    name = "nixl_raw"
    remote_layout = "mirror"

    def __init__(self, target: Target, arena: torch.Tensor | None = None) -> None:
        self.local = local_arena(target, pinned=False) if arena is None else arena
        self.path = "vram" if self.local.is_cuda else "host"
        self._nixl = BareNixl("bench-raw", self.local, target)
        self.remote_slots = self._nixl.remote_slots
        self.remote_base = self._nixl.remote_base
        self._pending: dict[int, Any] = {}
        self._ids = 0

    def submit(self, op: Op, call: Call) -> Hashable:
        self._ids += 1
        # Python lists, as the tier and vLLM's transport get them (NIXL takes either).
        self._pending[self._ids] = self._nixl.post(op, call.local_list, call.remote_list)
        return self._ids

    def reap(self, timeout: float) -> list[tuple[Hashable, float]]:
        out: list[tuple[Hashable, float]] = []
        for tid, handle in list(self._pending.items()):
            if self._nixl.done(handle):
                out.append((tid, time.perf_counter()))
                del self._pending[tid]
        if not out:
            # An empty pass yields the core: on a small machine a spinning initiator starves
            # the loopback target it is waiting for (TCP reads slowed 2x without this).
            os.sched_yield()
        return out

    def close(self) -> None:
        for handle in self._pending.values():
            self._nixl.release(handle)
        self._pending.clear()
        self._nixl.close()
