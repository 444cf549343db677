"""The data-plane contract: one local block region, remote peers, block transfers by index.

Names and semantics follow vLLM 0.33's ``vllm.v1.kv_offload.tiering.p2p.data`` contract, with
extensions: the region may be a torch tensor (host or CUDA) as well as a 2-D memoryview,
``read_blocks`` brings remote blocks back into local ones, and ``faulted_peers`` reports every
faulted peer at once.

Failure model (vLLM 0.33's). The transport decides each failure's scope. A *transfer* failure is
a submission that returned ``None`` or an id in ``PollResult.failed``. A *peer* fault means the
registration is unusable: one decisive error (a state check that raised, a remote disconnect, an
unknown remote agent) or repeated transfer failures with no success between. ``poll(peer_id)``
reports it in ``peer_fault`` until ``remove_remote_peer``; the transport never recovers a peer
itself. A transfer stays in flight unless the error proves it can no longer write (a remote
disconnect, or a later transfer that proves it over: ``nixl_inflight``'s fence): a
WRITE was measured to keep landing after its handle raised, so failing it early would let the
caller reuse a destination that is still being written. Submissions and polls
report failures through their results and do not raise for them.

Threading: implementations say what they allow (``NixlTransport``: any method from any thread).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import numbers
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

CancelMode = Literal["immediate", "wait"]
MemType = Literal["DRAM", "VRAM"]


class PollResult(NamedTuple):
    """Transfers that finished since the previous poll.

    ``done`` holds the ids that completed successfully, ``failed`` the ids that errored, were
    cancelled by ``remove_remote_peer`` or lost their peer. Each id appears in exactly one poll.
    ``peer_fault`` is set only by a peer-scoped ``poll(peer_id)`` once the transport judged that
    peer unusable: a short cause, repeated until ``remove_remote_peer``; ``None`` while healthy.
    """

    done: Sequence[int] = ()
    failed: Sequence[int] = ()
    peer_fault: str | None = None


@dataclass(frozen=True)
class BlockRegion:
    """Geometry and location of a contiguous ``num_blocks x block_len`` byte region.

    ``owner`` is the object whose memory this is (a tensor or memoryview); holding it keeps the
    memory alive for as long as the region is registered.
    """

    base_addr: int
    num_blocks: int
    block_len: int
    mem_type: MemType
    device_id: int
    owner: Any

    @classmethod
    def of(cls, region: memoryview | torch.Tensor) -> BlockRegion:
        """Describe ``region``; raise ``TypeError``/``ValueError`` naming what was expected."""
        if isinstance(region, memoryview):
            return cls._of_memoryview(region)
        torch = sys.modules.get("torch")  # not imported here: a host's DRAM pool never needs it
        if torch is not None and isinstance(region, torch.Tensor):
            return cls._of_tensor(region)
        raise TypeError(
            "block region must be a 2-D memoryview (num_blocks x block_len bytes) or a "
            f"contiguous 2-D torch.uint8 tensor, got {type(region).__name__}"
        )

    @classmethod
    def _of_tensor(cls, tensor: torch.Tensor) -> BlockRegion:
        import torch

        if tensor.dtype != torch.uint8:
            raise TypeError(f"block region tensor must be torch.uint8, got {tensor.dtype}")
        if tensor.dim() != 2:
            raise ValueError(
                f"block region tensor must be 2-D [num_blocks, block_len], got shape "
                f"{tuple(tensor.shape)}"
            )
        if not tensor.is_contiguous():
            raise ValueError("block region tensor must be contiguous; call .contiguous() first")
        if tensor.numel() == 0:
            raise ValueError(f"block region is empty: shape {tuple(tensor.shape)}")
        if tensor.device.type == "cuda":
            mem_type: MemType = "VRAM"
            device_id = tensor.device.index if tensor.device.index is not None else 0
        elif tensor.device.type == "cpu":
            mem_type, device_id = "DRAM", 0
        else:
            raise ValueError(f"block region must live on cpu or cuda, got {tensor.device}")
        return cls(
            base_addr=tensor.data_ptr(),
            num_blocks=tensor.shape[0],
            block_len=tensor.shape[1],
            mem_type=mem_type,
            device_id=device_id,
            owner=tensor,
        )

    @classmethod
    def _of_memoryview(cls, view: memoryview) -> BlockRegion:
        if view.ndim != 2 or view.shape is None:
            raise ValueError(f"block region memoryview must be 2-D, got ndim={view.ndim}")
        if view.itemsize != 1:
            raise TypeError(
                f"block region memoryview must be bytes (itemsize 1), got format {view.format!r}"
            )
        if not view.c_contiguous:
            raise ValueError("block region memoryview must be C-contiguous")
        if view.readonly:
            raise ValueError("block region memoryview must be writable (blocks are read into it)")
        num_blocks, block_len = view.shape
        if num_blocks == 0 or block_len == 0:
            raise ValueError(f"block region is empty: shape {tuple(view.shape)}")
        base_addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        return cls(base_addr, num_blocks, block_len, "DRAM", 0, view)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_len


def block_indices(idxs: Sequence[int], limit: int, what: str) -> list[int]:
    """Check block indices into ``[0, limit)`` and return them as a list of ints.

    Raises ``TypeError`` for anything but ints (``bool`` included: ``True`` is not block 1),
    ``IndexError`` for an index out of range; ``what`` names the indices in the message.
    Plain-Python checks: for the short lists of a KV transfer they cost far less than numpy's.
    """
    out = idxs.tolist() if isinstance(idxs, np.ndarray) else list(idxs)
    kinds = set(map(type, out))
    if kinds - {int}:
        bad = next(k for k in kinds if k is not int)
        if issubclass(bad, bool) or not issubclass(bad, (int, np.integer)):
            raise TypeError(f"{what} indices must be ints, got {bad.__name__}")
        out = [int(i) for i in out]
    if out and (min(out) < 0 or max(out) >= limit):
        bad_idx = next(i for i in out if not 0 <= i < limit)
        raise IndexError(f"{what} block index {bad_idx} out of range [0, {limit})")
    return out


def config_fingerprint(config_fields: dict[str, Any] | None) -> str:
    """First 16 hex digits of SHA-256 over the canonical JSON of ``config_fields``.

    ``None`` or ``{}`` gives ``""``, which peers treat as "compatible with anything".
    """
    if not config_fields:
        return ""
    canonical = json.dumps(config_fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class DataTransport(ABC):
    """Owns a local block region and moves blocks between it and registered remote peers.

    Ownership: the transport keeps a reference to the region object for its whole life; the
    caller must not free or resize the memory before ``close()``.

    Transfers are identified by integer ids unique for the transport's lifetime. A submitted
    transfer is reported exactly once by ``poll`` (in ``done`` or ``failed``) unless it was
    cancelled with ``mode="immediate"``.
    """

    failures_are_final: bool = False
    """Our extension: True when nothing of a transfer lands after the transport refused it
    (``None``) or reported it ``failed``. Otherwise (vLLM's contract) part of it may still land
    after that, so a caller keeps the slots a failed write targeted fenced for good."""

    def __init__(
        self, region: memoryview | torch.Tensor, config_fields: dict[str, Any] | None = None
    ) -> None:
        self._region = BlockRegion.of(region)
        self._config_fingerprint = config_fingerprint(config_fields)

    @property
    def region(self) -> BlockRegion:
        """The local region's geometry and memory kind."""
        return self._region

    @property
    def base_addr(self) -> int:
        """Address of block 0 of the local region."""
        return self._region.base_addr

    @property
    def num_blocks(self) -> int:
        """Number of blocks in the local region."""
        return self._region.num_blocks

    @property
    def block_len(self) -> int:
        """Bytes per block; peers must use the same value."""
        return self._region.block_len

    @property
    def mem_type(self) -> MemType:
        """``"DRAM"`` for host memory, ``"VRAM"`` for CUDA device memory."""
        return self._region.mem_type

    @property
    def device_id(self) -> int:
        """CUDA device index for VRAM regions, 0 for DRAM."""
        return self._region.device_id

    @property
    def config_fingerprint(self) -> str:
        """Hash of the model configuration; peers with different non-empty values must not mix."""
        return self._config_fingerprint

    @abstractmethod
    def get_agent_metadata(self) -> bytes:
        """Opaque bytes a remote peer passes to its ``add_remote_peer`` to reach us."""

    @abstractmethod
    def add_remote_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register a peer's region. Re-adding a known ``peer_id`` replaces it.

        Raises ``ValueError`` when ``block_len`` differs from ours or ``num_blocks <= 0``.
        """

    def add_remote_peer_async(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> Future[None]:
        """Register a peer without blocking the caller; the future resolves once it can be used.

        A failed future means the peer must be rejected; a known peer keeps its working
        registration. This default runs ``add_remote_peer`` inline and returns a resolved
        future, for transports whose registration is cheap.
        """
        future: Future[None] = Future()
        try:
            self.add_remote_peer(peer_id, agent_metadata, base_addr, num_blocks, block_len)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        return future

    @abstractmethod
    def remove_remote_peer(self, peer_id: str) -> None:
        """Forget a peer at once, also over a registration still running (that one is dropped).

        Its in-flight transfers stay in flight and are reported by ``poll`` when they resolve
        (cancel them to stop tracking them). Clears the peer's fault. Unknown ids are ignored.
        """

    def drop_remote_peer(self, peer_id: str) -> None:
        """``remove_remote_peer`` for a peer that will likely be registered again from the same
        metadata (a host dropped after its control connection was lost, dialled again); our
        extension. A transport may keep what a new registration would reuse (the NIXL
        transport keeps the remote agent loaded: ``nixl_peers``)."""
        self.remove_remote_peer(peer_id)

    @abstractmethod
    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        """Start copying local blocks into the peer's blocks; return the transfer id.

        Returns ``None`` when the peer is unknown or the submission failed (logged). Raises
        ``ValueError``/``IndexError`` for bad indices before anything is submitted. A transport
        whose ``failures_are_final`` returns an id for a submission that failed once part of it
        may have been sent, and reports it ``failed`` once nothing more of it can land (the NIXL
        transport fences it: ``nixl_inflight``).
        """

    @abstractmethod
    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int | None:
        """Start copying the peer's blocks into local blocks; same contract as ``write_blocks``."""

    @abstractmethod
    def poll(self, peer_id: str | None = None) -> PollResult:
        """Report transfers that finished since the last poll: all peers', or only ``peer_id``'s.

        Transfers of other peers stay in flight and are reported by a later poll; ``PROC`` and
        ``PEND`` are in progress. Empty fields are ``()``. A scoped poll carries the peer's fault.
        """

    def faulted_peers(self) -> dict[str, str]:
        """Peers judged unusable (peer id -> cause) until ``remove_remote_peer``; our extension.

        The same causes ``poll(peer_id)`` reports as ``peer_fault``, for callers that poll all
        peers at once. A transport that never judges peers returns ``{}``.
        """
        return {}

    @abstractmethod
    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> list[int]:
        """Cancel in-flight transfers; unknown ids are ignored.

        ``"immediate"`` releases each handle and forgets the transfer (it is never polled) and
        returns ``[]``. ``"wait"`` checks each state first and releases only stopped transfers;
        the ids still ``PROC``/``PEND`` (or whose release failed) stay in flight and are returned:
        keep polling until they surface. After a remote disconnect the id is dropped.
        """

    @abstractmethod
    def close(self) -> None:
        """Cancel what is in flight and release every handle and registration. Idempotent.

        Afterwards every other method raises ``RuntimeError``.
        """

    def on_released(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once nothing can land in the local region any more (after ``close``
        released everything); our extension. This default runs it at once: for transports whose
        ``close`` releases everything before it returns. ``NixlTransport`` may finish its release
        later (a registration stuck past ``close``), and runs it then, on that thread; it never
        runs it when its agent outlives the close with transfers it may still run
        (``agent_lifetime``)."""
        callback()


# Past this, a block address does not fit the int64 descriptors a transport builds.
_ADDRESS_LIMIT = 2**63


def check_peer_region(
    peer_id: str, base_addr: int, num_blocks: int, block_len: int, local_len: int, device_id: int
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the peer's region is
    ``num_blocks`` blocks of ``local_len`` bytes at a non-negative ``base_addr`` that fits
    the int64 descriptors a transport builds, on a non-negative ``device_id``. Ints only
    (``bool`` is not one)."""
    for name, value in (
        ("base_addr", base_addr),
        ("num_blocks", num_blocks),
        ("block_len", block_len),
        ("device_id", device_id),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"peer {peer_id!r} {name} must be an int, got {type(value).__name__}")
    if block_len != local_len:
        raise ValueError(
            f"peer {peer_id!r} block_len {block_len} != local block_len {local_len}: "
            "both sides must use the same block size"
        )
    if num_blocks <= 0:
        raise ValueError(f"peer {peer_id!r} num_blocks must be > 0, got {num_blocks}")
    if device_id < 0:
        raise ValueError(f"peer {peer_id!r} device_id must be >= 0, got {device_id}")
    if not 0 <= base_addr <= _ADDRESS_LIMIT - num_blocks * block_len:
        raise ValueError(
            f"peer {peer_id!r} base_addr {base_addr:#x} with {num_blocks} blocks of {block_len} B "
            f"is not a region in [0, {_ADDRESS_LIMIT:#x}): pass the address its peer advertised"
        )
