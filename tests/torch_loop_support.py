"""Helpers shared by the torch-loop tests (``test_torch_loop*``): the caches' geometry (one page
across all layers is always ``BLOCK_LEN`` bytes), random caches, TCP hosts to freeze, and what
a restore brought back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from remote_support import wait_for

from torch_kv_tier.connections import REDIAL_THREAD
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader
from torch_kv_tier.integrations.torch_loop.model import DecoderConfig
from torch_kv_tier.remote.launch import ServerProcess

PAGE = 8
CONFIG = DecoderConfig(vocab_size=128, hidden=64, layers=2, heads=2, ffn=128, max_positions=512)
# Every cache below is [NUM_PAGES, PAGE, HEADS, HEAD_BYTES // itemsize] x LAYERS, so one page
# across all layers is always BLOCK_LEN bytes and one server serves every dtype.
LAYERS, HEADS, HEAD_BYTES, NUM_PAGES = 2, 2, 128, 24
BLOCK_LEN = LAYERS * 2 * PAGE * HEADS * HEAD_BYTES
assert CONFIG.layers * 2 * PAGE * CONFIG.hidden * 4 == BLOCK_LEN  # the float32 decoder's pages

DIALLING_THREADS = (REDIAL_THREAD, "tkvt-connect")  # the tier's redialer, a connect's

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def module_host() -> Any:
    """A module-scoped fixture ``remote``: the address of one ``torch-kv-tier serve`` host on
    loopback, started once for the test module that assigns it (``remote = module_host()``)."""

    @pytest.fixture(scope="module", name="remote")
    def host() -> Iterator[str]:
        with ServerProcess.start(1024, BLOCK_LEN, host="127.0.0.1") as server:
            yield str(server.address)

    return host


def random_caches(
    dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    head_dim = HEAD_BYTES // torch.empty(0, dtype=dtype).element_size()
    shape = (NUM_PAGES, PAGE, HEADS, head_dim)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def page(caches: list[torch.Tensor], page_id: int) -> torch.Tensor:
    return torch.stack([c[page_id] for c in caches]).cpu()


@contextlib.contextmanager
def tcp_hosts(
    monkeypatch: pytest.MonkeyPatch, count: int, seed: int
) -> Iterator[tuple[PagedKVOffloader, list[ServerProcess], list[str]]]:
    """``count`` hosts over UCX's TCP transport (a stopped host's reads stay on the wire) and an
    offloader (4 arena slots, 3 s timeout) joined to all: it, the hosts and their peer ids."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    keys_c, values_c = random_caches(torch.float32, seed=seed)
    with contextlib.ExitStack() as stack:
        hosts = [
            stack.enter_context(
                ServerProcess.start(64, BLOCK_LEN, host="127.0.0.1", env={"UCX_TLS": "tcp"})
            )
            for _ in range(count)
        ]
        off = stack.enter_context(
            PagedKVOffloader.create(
                keys_c, values_c, remote=hosts[0].address, arena_blocks=4, timeout=3.0
            )
        )
        # create's connect of it can fail (UCX "Connection refused" to an address the host
        # advertised: another process's test veth, gone since) and is then dialled again
        assert wait_for(lambda: len(off.manager.peers()) == 1, 30.0)
        ids = [*off.manager.peers(), *(off.connect(host.address) for host in hosts[1:])]
        assert all(ids)
        yield off, hosts, ids


def stored_pages(off: PagedKVOffloader, keys: list[bytes]) -> dict[bytes, list[torch.Tensor]]:
    """Each of ``keys`` with the key and value pages ``off`` offloads under it from pages 0.."""
    return {k: [page(off.key_caches, i), page(off.value_caches, i)] for i, k in enumerate(keys)}


def restored_exactly(
    off: PagedKVOffloader,
    stored: dict[bytes, list[torch.Tensor]],
    keys: list[bytes],
    dst: list[int],
) -> bool:
    """Whether pages ``dst`` of ``off``'s caches hold what was ``stored`` under ``keys``."""
    got = {k: [page(off.key_caches, p), page(off.value_caches, p)] for k, p in zip(keys, dst)}
    return all(all(map(torch.equal, got[k], stored[k])) for k in keys)
