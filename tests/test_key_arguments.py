"""What the calls taking keys accept and refuse: any iterable where order does not matter, a
generator, never a bool for an int key nor a container whose order is arbitrary (over
``late_write_support``'s in-process tier)."""

from __future__ import annotations

import array
import re
from typing import Any

import numpy as np
import pytest
from late_write_support import BLOCK, late_write_tier

from torch_kv_tier.arena import BlockArena


def test_discard_takes_its_keys_from_any_iterable() -> None:
    """``discard`` walked its keys twice (stores in flight, then the index): given a generator,
    the second walk found nothing, and the stored keys silently stayed."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        assert tier.store(["a", "b"], [0, 1]).result(timeout=5).ok
        tier.discard(key for key in ["a", "b"])
        assert tier.lookup(["a"]) == tier.lookup(["b"]) == 0


def test_a_bool_is_refused_by_every_call_taking_keys_as_store_refuses_it() -> None:
    """``store([True])`` was refused, but ``True == 1`` (and ``1.0``, ``np.int64(1)``) found the
    int key 1: ``lookup``, ``contains`` and ``holders`` answered for it, and ``discard([True])``
    forgot it."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        assert tier.store([1, 2], [0, 1]).result(timeout=5).ok
        for bad in (True, 1.0, np.int64(1)):
            with pytest.raises(TypeError) as refused:
                tier.store([bad], [2])
            said = re.escape(str(refused.value))
            with pytest.raises(TypeError, match=said):
                tier.contains(bad)
            for call in (tier.lookup, tier.holders, tier.touch, tier.prefetch, tier.discard):
                with pytest.raises(TypeError, match=said):
                    call([2, bad])
        assert tier.lookup([1, 2]) == 2 and tier.contains(1)


@pytest.mark.parametrize(
    ("keys", "advice"),
    [
        (memoryview(array.array("q", [1, 2])), r"view\.tolist\(\)"),
        (bytearray(b"ab"), r"\[bytes\(key\)\]"),
        (np.array([1, 2]), r"\.tolist\(\)"),
        ({1, 2}, "order is arbitrary: pass a list"),
    ],
    ids=["memoryview of ints", "bytearray", "numpy array of ints", "set"],
)
def test_a_container_of_keys_that_is_no_sequence_is_refused_with_what_to_pass(
    keys: Any, advice: str
) -> None:
    """A memoryview of ints was refused with "pass [key]", which does not fit it; a set was
    taken in its arbitrary order, so ``store`` paired its keys with the blocks by chance."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        for call, args in [
            (tier.store, (keys, [0, 1])),
            (tier.load, (keys, [0, 1])),
            (tier.lookup, (keys,)),
            (tier.holders, (keys,)),
        ]:
            with pytest.raises(TypeError, match=advice):
                call(*args)
        assert tier.stats().keys == 0


def test_calls_taking_keys_take_a_generator_and_those_not_answering_per_position_a_set() -> None:
    """``lookup`` of a generator raised "object of type 'generator' has no len()"."""
    with late_write_tier(BlockArena(8, BLOCK), {"p": 4}) as (tier, _):
        assert tier.store(["a", "b", "c"], [0, 1, 2]).result(timeout=5).ok
        assert tier.lookup(k for k in ["a", "b", "x"]) == 2
        assert tier.holders(k for k in ["a", "x"]) == ["p", None]
        tier.touch({"a", "b"})
        assert tier.prefetch({"a"}) == 0
        tier.discard({"a", "b"})
        assert tier.lookup(["c"]) == 1 and tier.stats().keys == 1
