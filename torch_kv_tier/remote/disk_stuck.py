"""``StuckRequests``: a ``disk_store.DiskStore``'s requests given up (not done within its
``request_timeout_s``: a hung device, a stuck NFS mount) and still in flight, and the
directories they hang.

A request given up may still touch its disk slots and, a read, its DRAM slot: its store keeps
them until the request ends (``ended``, asked at each ``poll``). Its directory hangs meanwhile
(``dirs``): the store posts it no write and refuses its reads.

Threading: not thread-safe; its store's thread calls every method.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch_kv_tier.remote.disk_io import DiskTransfers, Request

logger = logging.getLogger(__name__)


class StuckRequests:
    """The requests given up of one store's ``DiskTransfers`` (module docstring)."""

    def __init__(self, io: DiskTransfers) -> None:
        self._io = io
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: Request, path: Path, timeout_s: float) -> None:
        """``request``, to directory ``path``, was given up after ``timeout_s`` (logged)."""
        logger.warning(
            "disk %s of %d blocks in %s not done after %.0f s (a hung device?): given up, %s; "
            "no writes, nor reads, of that directory until it ends (the other directories take "
            "the copies)", request.kind, len(request.items), path, timeout_s,
            "its keys not copied" if request.kind == "write" else "its keys kept on disk",
        )  # fmt: skip
        self._requests.append(request)

    def dirs(self) -> set[int]:
        """The directories with a request given up still in flight."""
        return {request.directory for request in self._requests}

    def ended(self) -> list[tuple[Request, bool]]:
        """The requests that ended since the last call, each with whether it was done (else
        failed), now forgotten; the others stay."""
        ended, left = [], []
        for request in self._requests:
            state = self._io.state(request.handle, request.kind, request.directory)
            if state == "PROC":
                left.append(request)
            else:
                ended.append((request, state == "DONE"))
        self._requests = left
        return ended

    def take_all(self) -> list[Request]:
        """The requests still in flight, forgotten (``DiskStore.close`` keeps what they use)."""
        left, self._requests = self._requests, []
        return left
