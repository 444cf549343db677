"""``DiskTransfers``: NIXL POSIX requests between a host's DRAM pool and its block files, for
``disk_store.DiskStore`` (with the records of its requests and of what they completed).

The pool and every block file are registered once, and their slots prepared once as descriptor
lists (DRAM slot ``i`` at ``pool_addr + i * block_len``, file slot ``j`` at ``j * block_len``):
a request names slots by index, no byte and no per-block call goes through Python.

Requests run on io_uring where the kernel has it (``_create_backend``): posting or polling one
hands what would block to kernel workers, never waits for the device.

Threading and failures: not thread-safe; owned by one ``DiskStore``. On io_uring a request still in
flight when the thread that posted it exits is cancelled (``"ERR"``): post from a thread that
outlives its requests (the host's loop). A request NIXL refuses to start, or reports failed, is
logged (once until one of its kind to that file is done, naming its directory) and answered
``"ERR"``, never raised; construction
raises what NIXL raised, with everything it had made released.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch_kv_tier.keys import Key
from torch_kv_tier.transport.nixl_agent import descriptors

logger = logging.getLogger(__name__)

_agent_ids = itertools.count()
# what a failing request of a kind costs (``DiskIndex.take_slot``: what a write's failing does)
_COST = {
    "write": "the copies it carries (misses once DRAM evicts them); the blocks already there "
    "stay and are read, copies go to the other --disk directories, if any, and this one is "
    "tried at most once a second",
    "read": "its blocks a miss",
}

Pair = tuple[str, Key]


@dataclass
class DiskCompletions:
    """What ``DiskStore.poll`` reports since its last call."""

    written: list[Pair] = field(default_factory=list)
    read: list[tuple[str, Key, int, int]] = field(default_factory=list)  # ns, key, dram, digest
    # ns, key, dram slot; a read's key left the disk unless still ``contains``ed (``_finish``)
    failed: list[tuple[str, Key, int]] = field(default_factory=list)
    # reads given up (stuck): failed, but their DRAM slots may still be written: keep them
    abandoned: list[tuple[str, Key, int]] = field(default_factory=list)  # ns, key, dram slot
    released: list[int] = field(default_factory=list)  # DRAM slots of abandoned reads, ended


@dataclass
class Request:
    """One request a ``DiskStore`` posted, and what it moves."""

    handle: Any  # DiskTransfers.post's
    kind: str  # "write" or "read"
    items: list[tuple[str, Key, int, int, int]]  # ns, key, digest, disk slot, dram slot
    nbytes: int
    started: float  # perf_counter, for the throughput stats
    directory: int
    deadline: float  # monotonic: given up (stuck) past it


class DiskTransfers:
    """One NIXL agent with the POSIX backend over a pool and block files (module docstring).
    ``files`` are ``(fd, slots, directory)`` of each block file, in the order requests name
    them (``directory`` for the log)."""

    def __init__(
        self,
        files: Sequence[tuple[int, int, str]],
        *,
        block_len: int,
        pool_addr: int,
        pool_blocks: int,
        name: str,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self._agent: Any = nixl_agent(
            f"{name}-{os.getpid()}-{next(_agent_ids)}", nixl_agent_config(backends=[])
        )
        self._dram: Any = None
        self._files: list[Any] = []
        self._pool_reg: Any = None
        self._file_reg: Any = None
        self._failing: set[tuple[str, int]] = set()  # (kind, file): last request failed
        self._directories = [directory for _, _, directory in files]
        try:
            _create_backend(self._agent)
            pool = [(pool_addr, pool_blocks * block_len, 0, "")]
            self._pool_reg = self._agent.register_memory(pool, "DRAM", backends=["POSIX"])
            regs = [(0, slots * block_len, fd, "") for fd, slots, _ in files]
            self._file_reg = self._agent.register_memory(regs, "FILE", backends=["POSIX"])
            rows = descriptors(pool_addr, pool_blocks, block_len, 0)
            self._dram = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", rows, "DRAM", backends=["POSIX"]
            )
            self._files = [
                self._agent.prep_xfer_dlist(
                    self._agent.name,
                    descriptors(0, slots, block_len, fd),
                    "FILE",
                    backends=["POSIX"],
                )
                for fd, slots, _ in files
            ]
        except BaseException:
            self.close()
            raise

    def post(self, kind: str, f: int, dram: list[int], disk: list[int]) -> tuple[Any, str]:
        """Start a ``"write"`` (DRAM slots to slots of file ``f``) or ``"read"`` (the other way).
        Returns the request's handle (None if none was made) and its state: ``"ERR"`` when it
        could not start (logged), the handle then to be released all the same."""
        op = "WRITE" if kind == "write" else "READ"
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(
                op, self._dram, dram, self._files[f], disk, backends=["POSIX"]
            )
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._failed(kind, f, f"a {kind} of {len(dram)} blocks could not start: {exc}")
            state = "ERR"
        return handle, state

    def state(self, handle: Any, kind: str, f: int) -> str:
        """``"PROC"`` (in flight), ``"DONE"`` or ``"ERR"`` (logged, ``_failed``) of a request
        to file ``f``."""
        try:
            state = str(self._agent.check_xfer_state(handle))
        except Exception as exc:  # NIXL raises on a failed request
            self._failed(kind, f, f"a {kind} failed: {exc}")
            return "ERR"
        if state == "DONE" and (kind, f) in self._failing:
            self._failing.discard((kind, f))
            logger.info("disk %ss in %s succeed again", kind, self._directories[f])
        return state

    def _failed(self, kind: str, f: int, what: str) -> None:
        """Log a failed request to file ``f``: a warning for the first since one of its
        ``kind`` to ``f`` was done, at debug level after it (a read-only or dead file system
        fails every request: one line, not one per request)."""
        where = self._directories[f]
        if (kind, f) in self._failing:
            logger.debug("disk: %s: %s", where, what)
            return
        self._failing.add((kind, f))
        logger.warning(
            "disk: %s: %s; each %s there failing costs %s; logged again once a %s there is "
            "done: check the file system of %s (read-only, full, failing device?)",
            where, what, kind, _COST[kind], kind, where,
        )  # fmt: skip

    def release(self, handle: Any) -> None:
        """Release a request's handle (a failure is logged at debug level)."""
        if handle is not None and self._agent is not None:
            quietly(lambda: self._agent.release_xfer_handle(handle))

    def close(self) -> None:
        """Release the descriptor lists and registrations. Idempotent."""
        agent = self._agent
        if agent is None:
            return
        for dlist in [self._dram, *self._files]:
            if dlist is not None:
                quietly(lambda h=dlist: agent.release_dlist_handle(h))
        for reg in (self._file_reg, self._pool_reg):
            if reg is not None:
                quietly(lambda r=reg: agent.deregister_memory(r, backends=["POSIX"]))
        # the last references to the agent: its backend (an io_uring's descriptor) goes now,
        # not whenever this object does
        self._agent = self._dram = self._pool_reg = self._file_reg = None
        self._files = []


def _create_backend(agent: Any) -> None:
    """NIXL's POSIX backend on io_uring, which hands I/O that would block (buffered I/O, a
    device that does not answer, a full request queue) to kernel workers; else on its default,
    Linux AIO, whose ``io_submit`` does that I/O in the caller: the host's loop (logged)."""
    try:
        agent.create_backend("POSIX", {"use_uring": "true"})
    except Exception as exc:  # a kernel, or a container's seccomp profile, without io_uring
        logger.warning(
            "disk: no io_uring (%s): Linux AIO instead, which blocks the host's loop while a "
            "buffered or stuck disk request is submitted", exc,
        )  # fmt: skip
        agent.create_backend("POSIX", {})


def quietly(action: Any) -> None:
    try:
        action()
    except Exception:
        logger.debug("disk: release failed", exc_info=True)
