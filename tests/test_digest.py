"""``digest``: a block's digest is xxh3-64 of its bytes seeded with its key, whatever its size,
computed without handing the GIL away (python-xxhash releases it for inputs over 64 KiB)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import xxhash

from torch_kv_tier import digest
from torch_kv_tier.digest import CHUNK, BlockDigests, block_digest
from torch_kv_tier.keys import key_fingerprint

SIZES = [16 << 10, CHUNK, CHUNK + 1, 256 << 10, (1 << 20) + 4096]


def _arena(block_len: int, blocks: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(block_len)
    return torch.randint(0, 256, (blocks, block_len), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("block_len", SIZES)
def test_a_digest_is_xxh3_of_the_whole_block_seeded_with_its_key(block_len: int) -> None:
    arena = _arena(block_len)
    keys = ["a", b"b", 7]
    expected = [
        xxhash.xxh3_64_intdigest(arena[i].numpy().tobytes(), key_fingerprint(k))
        for i, k in enumerate(keys)
    ]
    assert BlockDigests(arena).of([0, 1, 2], keys) == expected  # what other tiers compute
    assert [block_digest(arena[i].numpy(), k) for i, k in enumerate(keys)] == expected
    assert BlockDigests(arena).of([2, 0], [7, "a"]) == [expected[2], expected[0]]


@pytest.mark.parametrize("block_len", SIZES)
def test_xxhash_is_never_given_more_than_a_chunk(
    block_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths: list[int] = []

    def one_call(data: Any, seed: int) -> int:
        lengths.append(memoryview(data).nbytes)
        return xxhash.xxh3_64_intdigest(data, seed)

    class Recording:
        def __init__(self, seed: int) -> None:
            self._state = xxhash.xxh3_64(seed=seed)

        def update(self, data: Any) -> None:
            lengths.append(memoryview(data).nbytes)
            self._state.update(data)

        def intdigest(self) -> int:
            return self._state.intdigest()

    monkeypatch.setattr(digest, "_xxh3", one_call)
    monkeypatch.setattr(digest, "_xxh3_state", Recording)
    arena = _arena(block_len)
    got = BlockDigests(arena).of([0, 1], ["x", "y"])
    got.append(block_digest(arena[2].numpy(), "z"))
    assert sum(lengths) == 3 * block_len
    assert max(lengths) <= CHUNK
    monkeypatch.undo()
    assert got == BlockDigests(arena).of([0, 1, 2], ["x", "y", "z"])


def _staged_digests_agree_with_the_host(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device arena's digests (staged through each thread's buffer, ``STAGING_BYTES`` at a
    time) equal the host's, for calls longer than the buffer and from threads at once."""
    block_len = 96 << 10  # hashed in pieces
    monkeypatch.setattr(digest, "STAGING_BYTES", 2 * block_len + 1)  # two blocks per copy
    host = _arena(block_len, blocks=7)
    keys = list(range(7))
    expected = BlockDigests(host).of(range(7), keys)
    staged = BlockDigests(host.to(device))
    staged._rows = None  # the device path, also for a CPU tensor (then unpinned)
    assert staged.of([6, 0, 3, 1, 5], [6, 0, 3, 1, 5]) == [expected[i] for i in (6, 0, 3, 1, 5)]
    assert staged.of([2], [2]) == [expected[2]]

    def digest_many(order: list[int]) -> list[list[int]]:
        return [staged.of(order, order) for _ in range(20)]

    orders = [list(range(7)), list(range(6, -1, -1))]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(digest_many, orders))
    for order, got in zip(orders, results):
        assert got == [[expected[i] for i in order]] * 20


def test_a_device_arena_is_staged_a_bounded_copy_at_a_time_per_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _staged_digests_agree_with_the_host("cpu", monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_arena_digests_as_the_host_does(monkeypatch: pytest.MonkeyPatch) -> None:
    _staged_digests_agree_with_the_host("cuda", monkeypatch)
