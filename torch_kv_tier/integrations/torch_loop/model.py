"""A small decoder-only transformer in plain PyTorch that reads and writes a paged KV cache.

It exists to exercise :class:`~torch_kv_tier.integrations.torch_loop.offloader.PagedKVOffloader`
end to end: seeded random weights (no downloads), greedy generation, and a computation order that
makes a restored prefix give *bit-identical* logits to a full recompute.

Determinism contract: a prompt is processed in chunks that end on page boundaries (the first chunk
after ``start`` runs to the end of its page, then one chunk per page), and every chunk's attention
reads keys and values back from the cache pages, never from the chunk's own activations. So the
computation of page ``j`` depends only on the tokens and on the *contents* of pages ``0..j-1``,
with the same tensor shapes whether those pages were computed a moment ago or restored from a
tier. Restoring byte-exact pages therefore reproduces every later bit. Batch-size dependent
kernels never see a different shape, which is what usually breaks such comparisons.

Not thread-safe: one generation loop per :class:`PagedKVCache`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DecoderConfig", "PagedKVCache", "TinyDecoder"]


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of :class:`TinyDecoder`; ``seed`` fixes its random weights."""

    vocab_size: int = 512
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024
    max_positions: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.hidden, self.layers, self.heads, self.ffn) < 1:
            raise ValueError(f"every DecoderConfig size must be >= 1: {self}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class PagedKVCache:
    """Per-layer key and value page pools, each ``[num_pages, page_size, heads, head_dim]``.

    ``keys[layer]`` and ``values[layer]`` are the tensors a :class:`PagedKVOffloader` is built
    over. Pages are handed out by :meth:`allocate` and returned by :meth:`free`; a sequence owns
    the list of pages it was given (its page table).
    """

    def __init__(
        self,
        config: DecoderConfig,
        num_pages: int,
        page_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        shape = (num_pages, page_size, config.heads, config.head_dim)
        self.page_size = page_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.layers)]
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Number of pages that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages; raises ``RuntimeError`` (nothing taken) if fewer are free."""
        if n > len(self._free):
            raise RuntimeError(f"KV cache full: {n} pages requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the pool (their contents stay until overwritten)."""
        self._free.extend(reversed(pages))


class TinyDecoder:
    """Pre-norm decoder with learned positions, multi-head attention over a paged KV cache.

    Weights are drawn from ``torch.Generator().manual_seed(config.seed)`` on the CPU and then
    moved to ``device``/``dtype``, so equal configs give equal weights on every host.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        d, f = config.hidden, config.ffn

        def weight(*shape: int, scale: float) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen) * scale
            return w.to(device=device, dtype=dtype)

        self.embed = weight(config.vocab_size, d, scale=1.0)
        self.positions = weight(config.max_positions, d, scale=0.1)
        self.layers = [
            {
                "qkv": weight(d, 3 * d, scale=d**-0.5),
                "out": weight(d, d, scale=d**-0.5),
                "up": weight(d, f, scale=d**-0.5),
                "down": weight(f, d, scale=f**-0.5),
                "norm1": torch.ones(d, device=device, dtype=dtype),
                "norm2": torch.ones(d, device=device, dtype=dtype),
            }
            for _ in range(config.layers)
        ]
        self.final_norm = torch.ones(d, device=device, dtype=dtype)
        self.lm_head = weight(d, config.vocab_size, scale=d**-0.5)
        self.device = torch.device(device)

    @torch.inference_mode()
    def forward_chunk(
        self, tokens: torch.Tensor, start: int, pages: Sequence[int], cache: PagedKVCache
    ) -> torch.Tensor:
        """Run positions ``start .. start + len(tokens) - 1``; return their logits ``[T, vocab]``.

        Writes those positions' keys and values into ``cache`` through the page table ``pages``
        and attends over positions ``0 .. start + T - 1`` read back from the cache, so positions
        before ``start`` must already be in the pages (computed or restored).
        """
        cfg, page = self.config, cache.page_size
        t = tokens.numel()
        end = start + t
        if end > cfg.max_positions:
            raise ValueError(f"position {end - 1} exceeds max_positions {cfg.max_positions}")
        if cache.pages_for(end) > len(pages):
            raise ValueError(f"{len(pages)} pages cannot hold {end} positions of {page}")
        table = torch.as_tensor(list(pages), dtype=torch.long, device=self.device)
        ctx_pos = torch.arange(end, device=self.device)
        ctx_slots = table[ctx_pos // page] * page + ctx_pos % page
        new_slots = ctx_slots[start:]
        causal = ctx_pos[None, :] > ctx_pos[start:, None]  # [T, S]: True = masked out

        x = self.embed[tokens.to(self.device)] + self.positions[start:end]
        for w, k_pages, v_pages in zip(self.layers, cache.keys, cache.values, strict=True):
            q, k, v = (_rms_norm(x, w["norm1"]) @ w["qkv"]).view(t, 3, cfg.heads, -1).unbind(1)
            k_flat = k_pages.view(-1, cfg.heads, cfg.head_dim)
            v_flat = v_pages.view(-1, cfg.heads, cfg.head_dim)
            k_flat.index_copy_(0, new_slots, k.to(k_flat.dtype))
            v_flat.index_copy_(0, new_slots, v.to(v_flat.dtype))
            keys = k_flat.index_select(0, ctx_slots).to(x.dtype).transpose(0, 1)  # [H, S, D]
            values = v_flat.index_select(0, ctx_slots).to(x.dtype).transpose(0, 1)
            scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * (cfg.head_dim**-0.5)
            scores = scores.float().masked_fill(causal, -math.inf)
            attn = torch.softmax(scores, dim=-1).to(x.dtype) @ values  # [H, T, D]
            x = x + attn.transpose(0, 1).reshape(t, cfg.hidden) @ w["out"]
            x = x + F.gelu(_rms_norm(x, w["norm2"]) @ w["up"]) @ w["down"]
        return _rms_norm(x, self.final_norm) @ self.lm_head

    def prefill(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        pages: Sequence[int],
        cache: PagedKVCache,
        *,
        start: int = 0,
    ) -> torch.Tensor:
        """Process ``token_ids[start:]`` page by page; return the last position's logits.

        ``start`` is the number of leading positions already in the pages (restored from a
        tier): it must be a multiple of the page size and below ``len(token_ids)``.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        page = cache.page_size
        if start % page or not 0 <= start < ids.numel():
            raise ValueError(
                f"start must be a multiple of page_size {page} below the prompt length "
                f"{ids.numel()}, got {start}"
            )
        logits = torch.empty(0)
        for chunk_start in range(start, ids.numel(), page):
            chunk = ids[chunk_start : chunk_start + page]
            logits = self.forward_chunk(chunk, chunk_start, pages, cache)
        return logits[-1]

    def generate(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        pages: Sequence[int],
        cache: PagedKVCache,
        max_new_tokens: int,
        *,
        start: int = 0,
    ) -> tuple[list[int], torch.Tensor]:
        """:meth:`prefill` then :meth:`decode`: the new tokens and their logits."""
        num_tokens = len(token_ids)
        first = self.prefill(token_ids, pages, cache, start=start)
        return self.decode(first, num_tokens, pages, cache, max_new_tokens)

    def decode(
        self,
        first_logits: torch.Tensor,
        num_tokens: int,
        pages: Sequence[int],
        cache: PagedKVCache,
        max_new_tokens: int,
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding after a prompt of ``num_tokens`` whose last logits are ``first_logits``.

        Returns the new tokens and a ``[max_new_tokens, vocab]`` logits tensor whose row ``i``
        chose new token ``i`` (row 0 is ``first_logits``). ``pages`` must hold
        ``num_tokens + max_new_tokens - 1`` positions.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if cache.pages_for(num_tokens + max_new_tokens - 1) > len(pages):
            raise ValueError(f"{len(pages)} pages are too few for the prompt and new tokens")
        rows = [first_logits]
        new = [int(first_logits.argmax())]
        for pos in range(num_tokens, num_tokens + max_new_tokens - 1):
            token = torch.tensor([new[-1]], dtype=torch.long)
            rows.append(self.forward_chunk(token, pos, pages, cache)[-1])
            new.append(int(rows[-1].argmax()))
        return new, torch.stack(rows)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
