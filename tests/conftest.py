"""Shared fixtures: remote peers in other processes, a tier's block geometry, a disk tier's
DRAM pool, a local NIXL transport, the vLLM tier tests' remote host."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from remote_peer import RemotePeer  # noqa: E402

BLOCK_LEN = 4096


@pytest.fixture
def peer() -> Iterator[RemotePeer]:
    """One remote peer process with 1,024 blocks of 4 KiB."""
    with RemotePeer(1024, BLOCK_LEN) as p:
        yield p


@pytest.fixture
def peer2() -> Iterator[RemotePeer]:
    """A second, independent remote peer process."""
    with RemotePeer(1024, BLOCK_LEN) as p:
        yield p


@pytest.fixture
def no_gc() -> Iterator[None]:
    """No automatic collection: what is freed is freed by reference counting alone."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def disk_pool() -> np.ndarray:
    """A DRAM pool for a disk tier's tests: ``disk_support.DISK_POOL`` page-aligned rows of
    ``DISK_BLOCK`` random bytes."""
    from disk_support import make_disk_pool

    return make_disk_pool()


@pytest.fixture
def local() -> Iterator[Any]:
    """A ``NixlTransport`` named ``local`` over 1,024 zeroed blocks of ``transport_support.BLOCK``
    bytes, closed after the test."""
    import torch
    from transport_support import BLOCK

    from torch_kv_tier.transport import NixlTransport

    t = NixlTransport("local", torch.zeros(1024, BLOCK, dtype=torch.uint8))
    yield t
    t.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    """The vLLM tier tests' remote host (``vllm_tier_support``'s geometry), one a test module,
    for the tests that leave it running; each tier leases its own slots."""
    from vllm_tier_support import CHUNK_BYTES, REMOTE_BLOCKS

    from torch_kv_tier.remote.launch import ServerProcess

    with ServerProcess.start(REMOTE_BLOCKS, CHUNK_BYTES) as srv:
        yield srv
