"""Copies between a paged KV cache and the tier's arena: one page of every layer per block.

A :class:`PageCopier` packs pages ``[page_size, heads, head_dim]`` of every layer's key and value
pools into arena blocks laid out as ``[layers, 2, page_size, heads, head_dim]`` (``gather``), and
unpacks them into any pages (``scatter``): one vectorized copy per layer, or one per call when the
arena slots are one contiguous run.

Threading and ownership: the caller (``PagedKVOffloader``, on its generation loop's thread) owns
the slots it passes, and no transfer may touch them during a copy. Every copy has finished when
the call returns (CUDA work is synchronized), so NIXL may then read or write the slots and the
caller may reuse the pages.

Copies move bits, whatever the float dtype: the caches and the arena are seen as integers of
the same item size (``float8`` has no CPU ``index_copy_``; integers have every index copy).

Every copy runs under ``torch.inference_mode()``: it moves bytes, records no autograd, and works
whatever mode the caches or the arena were created in (a tensor created under inference mode
refuses in-place writes outside it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PageCopier"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PageCopier:
    """Gathers cache pages into arena blocks and scatters blocks back (module docstring)."""

    def __init__(
        self,
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        blocks: torch.Tensor,
    ) -> None:
        """``blocks`` is the arena viewed as ``[slots, layers, 2, page_size, heads, head_dim]``
        in the caches' dtype; the caches are checked by ``PagedKVOffloader.block_len_for``."""
        self.key_caches = [_bits(cache) for cache in key_caches]
        self.value_caches = [_bits(cache) for cache in value_caches]
        self.device = self.key_caches[0].device
        self.blocks = _bits(blocks)

    @torch.inference_mode()
    def gather(self, pages: list[int], slots: list[int]) -> None:
        """Pack ``pages`` of every layer into arena ``slots`` (finished before it returns)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        packed = torch.stack(
            [
                torch.stack((k.index_select(0, index), v.index_select(0, index)), dim=1)
                for k, v in zip(self.key_caches, self.value_caches, strict=True)
            ],
            dim=1,
        )  # [n, layers, 2, page_size, heads, head_dim] on the caches' device
        run = _run_start(slots)
        if run is not None:
            self.blocks[run : run + len(slots)].copy_(packed)
        else:
            where = torch.tensor(slots, dtype=torch.long, device=self.blocks.device)
            self.blocks.index_copy_(0, where, packed.to(self.blocks.device))
        self._synchronize()

    @torch.inference_mode()
    def scatter(self, slots: list[int], pages: list[int]) -> None:
        """Unpack arena ``slots`` into ``pages`` of every layer (finished before it returns)."""
        if not slots:
            return
        run = _run_start(slots)
        if run is not None:
            packed = self.blocks[run : run + len(slots)]
        else:
            where = torch.tensor(slots, dtype=torch.long, device=self.blocks.device)
            packed = self.blocks.index_select(0, where)
        packed = packed.to(self.device)
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        for layer, (k, v) in enumerate(zip(self.key_caches, self.value_caches, strict=True)):
            k.index_copy_(0, index, packed[:, layer, 0])
            v.index_copy_(0, index, packed[:, layer, 1])
        self._synchronize()

    def _synchronize(self) -> None:
        # CUDA kernels that read or write the arena must finish before NIXL touches it or the
        # slots are reused.
        for device in {self.device, self.blocks.device}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` seen as integers of its item size, sharing memory (any strides: same size)."""
    return tensor.view(_BITS[tensor.element_size()])


def _run_start(slots: list[int]) -> int | None:
    """First slot if ``slots`` is one ascending contiguous run (a single copy), else None."""
    first = slots[0]
    return first if slots == list(range(first, first + len(slots))) else None
