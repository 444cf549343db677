"""``NixlTransport``: the ``DataTransport`` contract over a real NIXL agent.

This is the only module that imports ``nixl``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import os
import sys
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from torch_kv_tier.transport import agent_lifetime
from torch_kv_tier.transport.base import CancelMode, DataTransport, PollResult, block_indices
from torch_kv_tier.transport.ucx_env import apply_ucx_policy

logger = logging.getLogger(__name__)

_NOT_INSTALLED = "NIXL is not installed: run `pip install nixl` (it brings the UCX backend)"


def _load_nixl() -> tuple[Any, Any]:
    """Import NIXL after applying the UCX policy; raise ``ImportError`` telling how to install.

    NIXL's Python logger writes INFO lines to stdout by default; it is routed through
    ``logging`` instead, at the application's level (unless ``NIXL_LOG_LEVEL`` says otherwise),
    so the application decides what is shown and stdout stays the application's.
    """
    apply_ucx_policy()
    try:
        # NIXL's logging setup binds its console handler to sys.stdout at import time and may
        # log right away (NIXL_LOG_LEVEL): both go to stderr instead.
        with contextlib.redirect_stdout(sys.stderr):
            from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ImportError(_NOT_INSTALLED) from exc
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        if getattr(handler, "stream", None) in (sys.stdout, sys.stderr):
            nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    if "NIXL_LOG_LEVEL" not in os.environ:  # else NIXL's INFO lines pass any handler's level
        nixl_logger.setLevel(logging.NOTSET)
    return nixl_agent, nixl_agent_config


def _descriptors(base_addr: int, num_blocks: int, block_len: int, device_id: int) -> np.ndarray:
    """An ``N x 3`` array of (address, length, device) rows, one per block."""
    descs = np.empty((num_blocks, 3), dtype=np.int64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.int64) * block_len
    descs[:, 1] = block_len
    descs[:, 2] = device_id
    return descs


@dataclass
class _Peer:
    nixl_name: str
    dlist: Any
    num_blocks: int
    inflight: set[int] = field(default_factory=set)


@dataclass
class _Transfer:
    peer_id: str
    handle: Any


class NixlTransport(DataTransport):
    """A NIXL agent with one registration over the local region and prepared block lists.

    Args:
        local_id: Human-readable prefix of the NIXL agent name; a random suffix makes the agent
            name unique, so two transports with the same ``local_id`` never collide.
        region: 2-D memoryview or contiguous 2-D ``torch.uint8`` tensor (CPU: DRAM, CUDA: VRAM).
        config_fields: model config values hashed into ``config_fingerprint``.
        backends: NIXL backends (default ``["UCX"]``).
        num_threads: worker threads for multi-threaded backends (UCX).
        progress_thread: run NIXL's progress thread. It keeps one core busy even when idle, so it
            is off by default: an initiator progresses its transfers through ``poll``, and a
            passive target (a remote host) calls ``progress()`` from its own loop.

    Threading: ``_lock`` guards the NIXL agent (created with no internal synchronisation) and
    every table (``_peers``, ``_inflight``, ``_failed``, ``_closed``). Any method may be called
    from any thread; one thread may submit while another polls or cancels.
    """

    def __init__(
        self,
        local_id: str,
        region: memoryview | torch.Tensor,
        config_fields: dict[str, Any] | None = None,
        backends: list[str] | None = None,
        num_threads: int = 4,
        *,
        progress_thread: bool = False,
    ) -> None:
        super().__init__(region, config_fields)
        nixl_agent, nixl_agent_config = _load_nixl()
        self._local_id = local_id
        self._name = f"{local_id}-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[int, _Transfer] = {}
        self._failed: dict[int, str] = {}  # cancelled by peer removal: id -> peer_id
        self._ids = itertools.count(1)
        self._closed = False
        self._kept_until_exit = False  # see agent_lifetime
        agent_lifetime.check_room()
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            num_threads=num_threads,
            backends=list(backends) if backends else ["UCX"],
        )
        self._agent = nixl_agent(self._name, config)
        r = self.region
        try:
            self._reg = self._agent.register_memory(
                [(r.base_addr, r.nbytes, r.device_id, "")], mem_type=r.mem_type
            )
            descs = _descriptors(r.base_addr, r.num_blocks, r.block_len, r.device_id)
            self._local_dlist = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", descs, mem_type=r.mem_type
            )
        except Exception:
            self._agent = None
            raise
        logger.info(
            "NixlTransport %s: registered %d x %d B (%s, device %d)",
            self._name,
            r.num_blocks,
            r.block_len,
            r.mem_type,
            r.device_id,
        )

    @staticmethod
    def is_available() -> bool:
        """True when the ``nixl`` package can be imported."""
        return importlib.util.find_spec("nixl") is not None

    @property
    def agent_name(self) -> str:
        """The unique NIXL agent name (``local_id`` plus a random suffix)."""
        return self._name

    def get_agent_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    def add_remote_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
        *,
        mem_type: str = "DRAM",
        device_id: int = 0,
    ) -> None:
        """Register a peer region (extension: the peer's ``mem_type`` and ``device_id``)."""
        if block_len != self.block_len:
            raise ValueError(
                f"peer {peer_id!r} block_len {block_len} != local block_len {self.block_len}: "
                "both sides must use the same block size"
            )
        if num_blocks <= 0:
            raise ValueError(f"peer {peer_id!r} num_blocks must be > 0, got {num_blocks}")
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"peer mem_type must be 'DRAM' or 'VRAM', got {mem_type!r}")
        descs = _descriptors(base_addr, num_blocks, block_len, device_id)
        with self._lock:
            self._check_open()
            if peer_id in self._peers:
                self._drop_peer(peer_id)
            nixl_name = self._agent.add_remote_agent(agent_metadata)
            try:
                dlist = self._agent.prep_xfer_dlist(nixl_name, descs, mem_type=mem_type)
            except Exception:
                self._forget_agent(nixl_name)
                raise
            self._peers[peer_id] = _Peer(nixl_name, dlist, num_blocks)
        logger.info(
            "NixlTransport %s: peer %s = %s, %d blocks", self._name, peer_id, nixl_name, num_blocks
        )

    def remove_remote_peer(self, peer_id: str) -> None:
        with self._lock:
            self._check_open()
            if peer_id in self._peers:
                self._drop_peer(peer_id)

    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        return self._submit("WRITE", peer_id, local_idxs, remote_idxs)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        return self._submit("READ", peer_id, local_idxs, remote_idxs)

    def poll(self, peer_id: str | None = None) -> PollResult:
        done: list[int] = []
        failed: list[int] = []
        with self._lock:
            self._check_open()
            if peer_id is None:
                candidates: Iterable[int] = list(self._inflight)
                failed.extend(self._failed)
                self._failed.clear()
            else:
                peer = self._peers.get(peer_id)
                candidates = list(peer.inflight) if peer else ()
                gone = [tid for tid, pid in self._failed.items() if pid == peer_id]
                for tid in gone:
                    del self._failed[tid]
                failed.extend(gone)
            for tid in candidates:
                state = self._state(tid)
                if state == "DONE":
                    done.append(tid)
                elif state != "PROC":
                    failed.append(tid)
            for tid in itertools.chain(done, failed):
                xfer = self._inflight.pop(tid, None)
                if xfer is not None:
                    self._peers[xfer.peer_id].inflight.discard(tid)
                    self._release(tid, xfer.handle)
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> list[int]:
        if mode not in ("immediate", "wait"):
            raise ValueError(f"cancel mode must be 'immediate' or 'wait', got {mode!r}")
        still: list[int] = []
        with self._lock:
            self._check_open()
            for tid in transfer_ids:
                if self._failed.pop(tid, None) is not None:
                    continue
                xfer = self._inflight.get(tid)
                if xfer is None:
                    continue
                if mode == "wait":
                    try:
                        self._agent.release_xfer_handle(xfer.handle)
                    except Exception as exc:
                        logger.debug("transfer %d still draining: %s", tid, exc)
                        still.append(tid)
                        continue
                else:
                    self._release(tid, xfer.handle)
                del self._inflight[tid]
                self._peers[xfer.peer_id].inflight.discard(tid)
        return still

    def progress(self) -> None:
        """Drive the agent's progress once: what a passive target calls from its loop."""
        with self._lock:
            self._check_open()
            self._agent.get_new_notifs()

    def inflight_count(self) -> int:
        """Transfers submitted and not yet reported by ``poll`` (for stats and leak checks)."""
        with self._lock:
            return len(self._inflight) + len(self._failed)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tid, xfer in list(self._inflight.items()):
                self._release(tid, xfer.handle)
            self._inflight.clear()
            self._failed.clear()
            for peer in self._peers.values():
                peer.inflight.clear()
            for peer_id in list(self._peers):
                self._drop_peer(peer_id)
            for what, step in (
                (
                    "local descriptor list",
                    lambda: self._agent.release_dlist_handle(self._local_dlist),
                ),
                ("memory registration", lambda: self._agent.deregister_memory(self._reg)),
            ):
                try:
                    step()
                except Exception as exc:
                    logger.warning(
                        "NixlTransport %s: releasing %s failed: %s", self._name, what, exc
                    )
            # Every handle wrapper references the agent, released or not: drop them all, so
            # the agent is destroyed here, on this thread, not later by the collector.
            self._local_dlist = self._reg = None
            self._agent = None
        logger.info("NixlTransport %s: closed", self._name)

    # -- internals; callers hold self._lock ---------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NixlTransport {self._name} is closed")

    def _submit(
        self, op: str, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        local = block_indices(local_idxs, self.num_blocks, "local")
        if len(local) != len(remote_idxs):
            raise ValueError(
                f"{len(local)} local indices but {len(remote_idxs)} remote indices: "
                "they must pair up one to one"
            )
        if len(local) == 0:
            raise ValueError("no blocks to transfer: pass at least one index pair")
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_id)
            if peer is None:
                logger.warning("NixlTransport %s: %s to unknown peer %r", self._name, op, peer_id)
                return None
            remote = block_indices(remote_idxs, peer.num_blocks, "remote")
            dest = remote if op == "WRITE" else local
            if len(set(dest)) != len(dest):
                raise ValueError(f"{op} destination indices repeat: each block may be written once")
            handle = None
            try:
                handle = self._agent.make_prepped_xfer(
                    op, self._local_dlist, local, peer.dlist, remote
                )
                if self._agent.transfer(handle) == "ERR":
                    raise RuntimeError("NIXL refused to post the transfer")
            except Exception as exc:
                logger.error("NixlTransport %s: %s to %s failed: %s", self._name, op, peer_id, exc)
                if handle is not None and agent_lifetime.is_post_disconnect(exc):
                    self._keep_agent_until_exit()
                if handle is not None:
                    self._release(-1, handle)
                return None
            tid = next(self._ids)
            self._inflight[tid] = _Transfer(peer_id, handle)
            peer.inflight.add(tid)
            return tid

    def _state(self, tid: int) -> str:
        try:
            return str(self._agent.check_xfer_state(self._inflight[tid].handle))
        except Exception as exc:
            logger.warning("NixlTransport %s: transfer %d failed: %s", self._name, tid, exc)
            return "ERR"

    def _keep_agent_until_exit(self) -> None:
        """UCX may still hold a request NIXL freed: never destroy this agent (closed or not)."""
        if not self._kept_until_exit:
            self._kept_until_exit = True
            agent_lifetime.keep_until_exit(self._agent, self._name)

    def _release(self, tid: int, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.debug("NixlTransport %s: releasing transfer %d: %s", self._name, tid, exc)

    def _drop_peer(self, peer_id: str) -> None:
        """Cancel the peer's transfers (reported failed at next poll), then release its state."""
        peer = self._peers.pop(peer_id)
        for tid in sorted(peer.inflight):
            xfer = self._inflight.pop(tid)
            self._release(tid, xfer.handle)
            self._failed[tid] = peer_id
        try:
            self._agent.release_dlist_handle(peer.dlist)
        except Exception as exc:
            logger.warning(
                "NixlTransport %s: releasing %s's descriptors: %s", self._name, peer_id, exc
            )
        if not any(p.nixl_name == peer.nixl_name for p in self._peers.values()):
            self._forget_agent(peer.nixl_name)

    def _forget_agent(self, nixl_name: str) -> None:
        try:
            self._agent.remove_remote_agent(nixl_name)
        except Exception as exc:
            logger.warning("NixlTransport %s: removing agent %s: %s", self._name, nixl_name, exc)
