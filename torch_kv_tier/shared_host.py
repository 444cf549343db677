"""``SharedHost``: one shared ``torch-kv-tier serve`` host as a tier uses it: the slots the host
granted this tier, the stores waiting for them, the commits and recency it is told (the host's
half is ``remote.shared_cache``; the copy of its key set is the index's ``SharedSlots``).

A store writes into slots the host granted this tier ahead of time and commits its keys with
their digests once the write completed; a commit returns those slots from this tier's share of
the host's uncommitted grants, so the host may grant more. A store with no granted slot left
waits in ``awaiting`` until the next grant. A load reads straight from the slot the copy of the
index names, with no round trip to the host, and always verifies its digests (``verifies``):
nothing pins what it reads.

State only: no lock, no thread, no reference to the tier. The tier (``TierManager``) calls every
method under its lock and does the I/O: it sends the grant requests this object asks for
(``grant_wanted``) and routes their answers back (``granted``), on the session's I/O thread,
under the same lock.

Failure model: a session that ends (or is lost) ends this object's life with it; the tier then
fails what waits here (``take_awaiting``), and the host holds what the session may still write
until the tier releases it (``ended_sessions.EndedSessions``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain, takewhile
from typing import Any

from torch_kv_tier.index import BlockIndex
from torch_kv_tier.keys import Key
from torch_kv_tier.records import Op, Peer
from torch_kv_tier.slot_maps import SharedSlots, drain

MAX_GRANT = 4096  # the most slots one grant request asks a shared host for
DEFAULT_GRANT_BATCH = 512  # slots, unless RESERVE_BYTES of them is more
RESERVE_BYTES = 64 << 20  # at least this much of a reserve by default (small blocks)
PROMOTE_AGAIN_S = 1.0  # a promotion still awaited is asked for again after this long
MAX_PROMOTING = 4096  # promotions remembered before the old ones are forgotten


def default_grant_batch(block_len: int) -> int:
    """``TierManager``'s default ``grant_batch`` for blocks of ``block_len`` bytes: 512 slots,
    or as many as hold 64 MiB when that is more (at most ``MAX_GRANT``). The reserve must
    outlast what a tier writes while a top-up is on its way: a grant round trip (1.9 ms p50,
    8 ms p99 here) plus the commits not yet sent (up to 5 ms), about 40 MiB at 3 GB/s. With
    512 slots of 64 KiB (32 MiB), about 1 % of stores found it empty and waited."""
    return min(max(DEFAULT_GRANT_BATCH, RESERVE_BYTES // block_len), MAX_GRANT)


class SharedHost(Peer):
    """A shared host's registration (module docstring); ``session`` is its ``RemoteSession``."""

    __slots__ = (
        "__weakref__",  # its session's index follower holds it weakly
        "awaiting",
        "capped",
        "commits",
        "grant_batch",
        "grants",
        "outstanding",
        "promoting",
        "refilling",
        "reserve",
    )

    def __init__(self, slots: SharedSlots, session: Any, grant_batch: int) -> None:
        super().__init__(slots, verifies=True, session=session)
        self.grant_batch = grant_batch
        # the share of granted, uncommitted slots this tier keeps: the host's cap on one
        # session's (announced in its handshake), at most grant_batch
        self.reserve = min(grant_batch, session.max_granted or grant_batch)
        self.outstanding = 0  # slots the host counts as granted to this session: not committed
        self.grants: deque[int] = deque()  # granted slots not yet written, used in order
        self.awaiting: deque[Op] = deque()  # stores waiting for granted slots, in order
        self.refilling = False  # a grant request is in flight
        self.capped = False  # the host granted less than asked: ask again after a commit
        self.commits = 0  # commits sent (each returns granted slots to the host)
        # key on the host's disk -> when its promotion was first and last asked for, in order
        # of first asks (``promote`` forgets the oldest)
        self.promoting: dict[Key, tuple[float, float]] = {}

    # -- slots ----------------------------------------------------------------------------

    def take_slots(self, index: BlockIndex, n: int) -> list[int]:
        """Up to ``n`` granted slots (the host evicted for them when it granted them)."""
        return self._pop_grants(n)

    def return_slots(self, slots: list[int]) -> None:
        self.grants.extendleft(reversed(slots))  # back at the head, in their order

    def grant_wanted(self) -> int:
        """How many slots to ask the host for now (0: none).

        Stores waiting for slots ask at once. Otherwise the tier tops its ``reserve`` up once
        fewer than half of it is in hand and a quarter of it is room the host will grant again
        (slots committed since): one request per quarter reserve written, not one per commit.
        That top-up goes out with the next commits (``RemoteSession.grant``'s
        ``with_commits``), or at once when the tier is ``running_low``. After a grant that came
        short (the host's cap, the namespace's quota, nothing left to evict), only a commit or a
        waiting store asks again."""
        if self.refilling:
            return 0
        need = sum(len(op.keys) for op in self.awaiting)
        if need:
            return min(max(self.grant_batch, 2 * need), MAX_GRANT)
        room = self.reserve - self.outstanding
        if self.capped or len(self.grants) >= self.reserve // 2 or room < self.reserve // 4:
            return 0
        return room

    def running_low(self) -> bool:
        """Whether stores wait for slots, or will soon: a top-up must not wait for the next
        commits then (``RemoteSession.grant``'s ``with_commits``)."""
        return bool(self.awaiting) or len(self.grants) < self.reserve // 4

    def granted(self, slots: list[int], want: int, commits_then: int) -> None:
        """The host answered a request for ``want`` slots made after ``commits_then`` commits
        with ``slots``."""
        self.refilling = False
        self.grants.extend(slots)
        self.outstanding += len(slots)
        self.capped = len(slots) < want and self.commits == commits_then

    def starved(self, got_slots: bool, commits_then: int, inflight: Iterable[Op]) -> bool:
        """Whether the stores still waiting (once the granted slots were launched) can never
        get slots: the answer brought none, none of this tier's writes to the host is in
        flight (``inflight``: the tier's transfers in flight) or queued, and no commit went out
        since the request (either would make room in this tier's share; a load makes none)."""
        if not self.awaiting or got_slots or self.commits != commits_then:
            return False
        ops = chain(self.queue, inflight)
        return not any(op.kind == "store" and op.peer is self for op in ops)

    def launchable(self) -> Iterator[tuple[Op, Op | None]]:
        """Waiting stores that granted slots now cover, in order, each with its slots; a store
        only partly covered is split, and its rest (the second item) waits on at its head."""
        while self.awaiting and self.grants:
            op = self.awaiting.popleft()
            op.remote = self._pop_grants(len(op.keys))
            rest = None
            if len(op.remote) < len(op.keys):
                rest = op.split(len(op.remote))
                self.awaiting.appendleft(rest)
            yield op, rest

    def _pop_grants(self, n: int) -> list[int]:
        grants = self.grants
        return [grants.popleft() for _ in range(min(n, len(grants)))]

    def take_awaiting(self) -> list[Op]:
        """Every waiting store, for the tier to fail (the session ended, or capacity)."""
        ops, self.awaiting = list(self.awaiting), deque()
        return ops

    # -- what the host is told ------------------------------------------------------------

    def commit(self, keys: list[Key], slots: list[int], digests: list[int]) -> None:
        """Publish written ``keys`` to the host (batched by the session; a session that is
        ending drops it, and its loss drops this host)."""
        self.commits += 1
        self.capped = False
        self.outstanding -= len(keys)
        with contextlib.suppress(ConnectionError):
            self.session.commit(keys, slots, digests)

    def touch(self, keys: list[Key]) -> None:
        """Report recency (batched by the session)."""
        with contextlib.suppress(ConnectionError):
            self.session.touch(keys)

    def promote(self, keys: list[Key], now: float, timeout_s: float) -> list[Key]:
        """Ask the host to bring ``keys`` (on its disk) into DRAM, each at most once per
        ``PROMOTE_AGAIN_S``. Returns the keys whose promotion is awaited: first asked for less
        than ``timeout_s`` ago. A promotion the host could not make (no slot) is so given up
        after ``timeout_s``, and tried afresh once as long again has passed."""
        asked = self.promoting
        if len(asked) > MAX_PROMOTING:  # in order of first asks: the old ones lead
            old = takewhile(lambda item: now - item[1][0] > 2 * timeout_s, asked.items())
            drain(map(asked.pop, [key for key, _ in old]))
        send = []
        for key in keys:
            first, last = asked.get(key, (now, -PROMOTE_AGAIN_S))
            if now - first > 2 * timeout_s:
                first, last = now, -PROMOTE_AGAIN_S
                del asked[key]  # asked afresh: to the end, keeping that order
            if now - last >= PROMOTE_AGAIN_S and now - first < timeout_s:
                send.append(key)
                last = now
            asked[key] = (first, last)
        if send:
            with contextlib.suppress(ConnectionError):
                self.session.promote(send)
        return [k for k in keys if now - asked[k][0] < timeout_s]


__all__ = ["MAX_GRANT", "RESERVE_BYTES", "SharedHost", "default_grant_batch"]
