"""``SharedHost``'s grant bookkeeping, without a host: when a tier asks its shared host for
slots, and how many (issue 17: one grant request per quarter of the reserve written, not one
per commit; a commit goes out ahead of every request, so a request per commit also defeated
the commits' batching)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch_kv_tier.index import BlockIndex
from torch_kv_tier.shared_host import MAX_GRANT, SharedHost, default_grant_batch


class _Session:
    """What ``SharedHost`` uses of a ``RemoteSession``: the host's cap and ``commit``."""

    def __init__(self, max_granted: int) -> None:
        self.max_granted = max_granted
        self.commits: list[Any] = []

    def commit(self, keys: list[Any], slots: list[int], digests: list[int]) -> None:
        self.commits.append((keys, slots, digests))


def _host(max_granted: int, grant_batch: int = 512) -> SharedHost:
    slots = BlockIndex().add_shared_peer("host", 4096)
    return SharedHost(slots, _Session(max_granted), grant_batch)


def _write(host: SharedHost, n: int, first_key: int) -> None:
    """Take ``n`` granted slots, write them and commit their keys (as the tier does)."""
    slots = host.take_slots(BlockIndex(), n)
    assert len(slots) == n
    host.commit(list(range(first_key, first_key + n)), slots, [0] * n)


def test_the_reserve_is_the_hosts_cap_at_most_the_grant_batch() -> None:
    assert _host(max_granted=128).reserve == 128
    assert _host(max_granted=4096).reserve == 512
    assert _host(max_granted=0).reserve == 512  # a host that does not announce its cap


def test_the_default_reserve_holds_64_mib_of_small_blocks_and_512_large_ones() -> None:
    # a reserve must outlast a grant round trip plus the commits not yet sent: 512 slots of
    # 64 KiB (32 MiB) ran dry in about 1 % of stores at 3 GB/s
    assert default_grant_batch(64 << 10) == 1024
    assert default_grant_batch(16 << 10) == MAX_GRANT
    assert default_grant_batch(4 << 10) == MAX_GRANT
    assert default_grant_batch(128 << 10) == 512
    assert default_grant_batch(2 << 20) == 512


def test_a_tier_tops_its_reserve_up_once_a_quarter_of_it_is_room_not_after_every_commit() -> None:
    host = _host(max_granted=512)
    assert host.grant_wanted() == 512  # nothing in hand: the whole reserve
    host.refilling = True
    host.granted(list(range(512)), 512, host.commits)
    assert host.outstanding == 512 and not host.capped and host.grant_wanted() == 0
    asked = []
    for call in range(64):  # 64 stores of 16 keys, each committed at once
        _write(host, 16, 16 * call)
        want = host.grant_wanted()
        if want:
            asked.append((call, want))
            host.refilling = True
            host.granted(list(range(1000 + 16 * call, 1000 + 16 * call + want)), want, host.commits)
    # a request once fewer than half the reserve is in hand (and so over half of it is room):
    # 3 requests for 64 commits, each topping the reserve up again
    assert asked == [(16, 272), (33, 272), (50, 272)]
    assert len(host.session.commits) == 64


def test_a_short_answer_waits_for_a_commit_and_waiting_stores_ask_at_once() -> None:
    host = _host(max_granted=64)
    host.refilling = True
    host.granted(list(range(64)), 64, host.commits)
    _write(host, 48, 0)
    assert host.grant_wanted() == 48  # 16 in hand, 48 of the reserve room again
    host.refilling = True
    host.granted([], 48, host.commits)  # the host had not applied those commits yet
    assert host.capped and host.grant_wanted() == 0
    host.awaiting.append(SimpleNamespace(keys=list(range(40))))  # type: ignore[arg-type]
    assert host.grant_wanted() == 512  # stores wait: ask at once, for at least a batch
    host.awaiting.clear()
    _write(host, 16, 48)  # a commit since the short answer: room for the whole reserve
    assert not host.capped and host.grant_wanted() == 64
