"""What a store commits to a shared host: the digests every tier checks its loads of that key
against, on a tier that does not verify its private peers (``verify=False``)."""

from __future__ import annotations

from typing import Any

import torch
from late_write_support import late_write_tier
from remote_support import BLOCK_LEN
from tier_races_support import add_shared_host

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.digest import BlockDigests

RESULT_TIMEOUT_S = 10.0


def test_a_store_racing_a_shared_host_joining_commits_the_real_digest() -> None:
    """Found by review: with ``verify=False`` a store decided, before taking the lock,
    whether to digest its blocks; a shared host that joined between that decision and the
    lock received the key with digest 0, so every tier's load of it failed its check
    ("missing") until it aged out. Now the store commits the block's real digest."""
    arena = BlockArena(4, BLOCK_LEN)
    arena.tensor[0].fill_(0x5A)
    with late_write_tier(arena, {}, verify=False) as (tier, _):
        commits: list[tuple[list[Any], list[int], list[int]]] = []
        joined: list[Any] = []
        decide = tier._digest_stores

        def decide_then_join() -> bool:  # the host joins right after the unlocked decision
            answer = decide()
            if not joined:
                joined.append(add_shared_host(tier, 8))
                joined[0][1].commit = lambda *args: commits.append(args)
            return answer

        tier._digest_stores = decide_then_join  # type: ignore[method-assign]
        stored = tier.store([b"k"], [0])
        host, session = joined[0]
        with tier._lock:
            tier._refill(host)
        session.answer([3])
        assert stored.result(timeout=RESULT_TIMEOUT_S).ok
        expected = BlockDigests(arena.tensor).of([0], [b"k"])
        assert commits == [([b"k"], [3], expected)], "the host got another digest"
        assert torch.equal(tier.transport.remotes[b"h"][3], arena.tensor[0])
