"""Offload a custom PyTorch loop's paged KV cache to torch_kv_tier remote hosts.

``PagedKVOffloader`` moves whole pages (every layer's keys and values) between per-layer page
pools ``[num_pages, page_size, heads, head_dim]`` and a tier; ``prefix_keys`` names pages by
chained hashes of their token prefix. ``model`` holds a small paged-KV decoder and ``example``
a runnable demo (``python -m torch_kv_tier.integrations.torch_loop.example``).
"""

from torch_kv_tier.integrations.torch_loop.keys import prefix_keys
from torch_kv_tier.integrations.torch_loop.offloader import OffloadError, PagedKVOffloader, Staging

__all__ = ["OffloadError", "PagedKVOffloader", "Staging", "prefix_keys"]
