"""``BlockArena``: the local block memory a tier stages KV blocks in, and its slot allocator."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Container, Iterable

import torch

from torch_kv_tier.remote.quantities import count, flag
from torch_kv_tier.slots import SlotPool
from torch_kv_tier.transport.base import BlockRegion

logger = logging.getLogger(__name__)

_warned_pageable = False


def can_pin_memory() -> bool:
    """Whether this torch build can page-lock host memory (it needs an accelerator runtime)."""
    return torch.cuda.is_available()


class BlockArena:
    """One contiguous ``torch.uint8`` tensor ``[num_blocks, block_len]`` plus a slot allocator.

    ``device="cpu"`` gives pinned host memory when an accelerator is present and pageable memory
    (with one logged warning) on a CPU-only build, zeroed at creation so that every page is
    resident before a transfer touches it; ``pin_memory=True`` insists on pinning and raises
    where that is impossible. ``device="cuda[:n]"`` gives device memory, which a
    ``NixlTransport`` registers as VRAM.

    ``num_blocks``/``block_len`` that are no whole number > 0 (numpy's ints taken) raise
    ``TypeError``/``ValueError`` naming them before anything is allocated (``quantities.count``),
    as does a ``pin_memory`` that is neither ``None`` nor a ``bool`` (``TypeError``).

    Threading: ``allocate``/``free`` are guarded by an internal lock; the tensor itself is the
    caller's to synchronise.
    """

    def __init__(
        self,
        num_blocks: int,
        block_len: int,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
    ) -> None:
        num_blocks, block_len = count("num_blocks", num_blocks), count("block_len", block_len)
        if pin_memory is not None:
            flag("pin_memory", pin_memory)
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {dev} requested but torch sees no CUDA device")
            if pin_memory:
                raise ValueError("pin_memory applies to host arenas only, not to a cuda arena")
            tensor = torch.empty(num_blocks, block_len, dtype=torch.uint8, device=dev)
        elif dev.type == "cpu":
            pinned = _choose_pinning(pin_memory)
            tensor = torch.empty(num_blocks, block_len, dtype=torch.uint8, pin_memory=pinned)
            if not pinned:  # (pinned memory is resident already)
                # Fault every page in now: a one-sided write from another process into a page
                # this process never touched costs the kernel a remote page fault per page
                # (measured: 0.07 GB/s into a fresh 4 GiB host pool, 1.8 GB/s into a touched one).
                tensor.zero_()
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda[:n]', got {dev}")
        self._adopt(tensor)

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> BlockArena:
        """Adopt an existing contiguous 2-D uint8 tensor (no copy); the caller keeps it alive."""
        BlockRegion.of(tensor)  # validates dtype, shape, contiguity, device
        arena = cls.__new__(cls)
        arena._adopt(tensor)
        return arena

    def _adopt(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._lock = threading.Lock()  # guards _slots
        self._slots = SlotPool(range(tensor.shape[0]))

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def block_len(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def is_pinned(self) -> bool:
        return self.tensor.device.type == "cpu" and self.tensor.is_pinned()

    def view(self, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        """The blocks seen as ``dtype [num_blocks, *shape]``, sharing memory (no copy).

        Raises ``ValueError`` when ``shape`` of ``dtype`` does not fill exactly one block.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * itemsize != self.block_len:
            raise ValueError(
                f"{dtype} {list(shape)} is {math.prod(shape) * itemsize} bytes, "
                f"but a block is {self.block_len} bytes"
            )
        return self.tensor.view(dtype).view(self.num_blocks, *shape)

    @property
    def num_free(self) -> int:
        with self._lock:
            return self._slots.num_free

    def allocate(self, n: int, into: list[int] | None = None) -> list[int]:
        """Reserve ``n`` slots (a contiguous run when possible); ``ValueError`` when full.
        ``into`` (if given) gains them in the step that takes them, so that a caller that a
        ``KeyboardInterrupt`` stops as they are handed out still has them (one inside the
        pool's own allocation may lose them: ``reclaim`` gets them back)."""
        with self._lock:
            taken = into if into is not None else []
            taken.extend(self._slots.allocate(n))
            return taken

    def free(self, idxs: Iterable[int]) -> None:
        """Release slots; ``ValueError`` on double free or an index not in this arena."""
        with self._lock:
            self._slots.free(idxs)

    def free_taken(self, idxs: Iterable[int], keep: Container[int] = ()) -> None:
        """Release those of ``idxs`` but ``keep`` that are taken, skipping those already
        free: a caller interrupted as it freed them may free them again, none twice (the
        caller must be the only one taking slots meanwhile)."""
        with self._lock:
            slots = self._slots
            slots.free([i for i in idxs if i not in keep and not slots.is_free(i)])

    def reclaim(self, owned: Container[int]) -> list[int]:
        """Free every taken slot not in ``owned`` (``SlotPool.reclaim``): the arena's only
        user, with no allocation of its own under way, gets back what an interrupt lost."""
        with self._lock:
            return self._slots.reclaim(owned)

    def is_free(self, idx: int) -> bool:
        with self._lock:
            return self._slots.is_free(idx)


def _choose_pinning(pin_memory: bool | None) -> bool:
    global _warned_pageable
    if can_pin_memory():
        return pin_memory is not False
    if pin_memory:
        raise RuntimeError(
            "pin_memory=True but this torch build cannot pin host memory (no accelerator); "
            "pass pin_memory=None to fall back to pageable memory"
        )
    if pin_memory is None and not _warned_pageable:
        _warned_pageable = True
        logger.warning("no accelerator: the block arena uses pageable host memory, not pinned")
    return False
