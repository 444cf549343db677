"""``digest``: a block's digest is xxh3-64 of its bytes seeded with its key, whatever its size,
computed without handing the GIL away (python-xxhash releases it for inputs over 64 KiB)."""

from __future__ import annotations

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
