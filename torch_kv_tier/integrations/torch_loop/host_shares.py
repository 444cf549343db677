"""Which hosts hold the offloader's arena slots past its timeout, and each host's share of a batch.

A read that timed out keeps its arena slots until it ends (a host frozen past the timeout: until it
resumes, which may be never); a store keeps its slots until the tier resolves it (a frozen host:
until its session is lost, about 10 s). A host with a read past its restore's deadline, or a
store under way for longer than the offloader's timeout (not its offload's deadline, which a
healthy host's store begun late in a long offload would pass), is *overdue*: a restore stops
before its first key and an offload fails its keys at once (:data:`OVERDUE`) until they end, so
that it takes no more slots, and the slots it holds are out of the *room* that batches
are sized to. With more than one host, a batch takes from one host at most half the room (rounded
down, at least one; the cost: a longer run of keys on one host goes in more round trips). Stores
under way to other hosts are out of a host's room too, and its own count against its share (an
offload's batches do not wait for each other's stores; one whose first key's host has no share left
waits for them). So the first frozen host holds at most half the arena, a second one half the rest,
and so on: ``k`` frozen hosts leave the other hosts' offloads and restores at least ``arena >> k``
slots (none once that is 0: a batch always takes one slot, so that small arenas work). Other hosts'
stores make a share smaller while they are under way (a healthy host's end at once); ``arena /
(hosts + 1)`` would cut every batch to a third of the arena with two hosts, frozen or not.

Threading: :class:`HostShares` is not locked; its owner (``ArenaBatches``) calls it under its
own lock.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from concurrent.futures import Future

from torch_kv_tier.results import TransferResult

__all__ = ["OVERDUE", "HostShares", "fitting"]

OVERDUE = "host overdue"  # offload of a key whose host's reads or stores are past their timeout


class HostShares:
    """The arena slots of ``size`` that overdue hosts hold (module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._reads: Counter[str | None] = Counter()  # slots of reads that timed out, by host
        # each store under way: its host, slots and offload's deadline
        self._stores: dict[Future[TransferResult], tuple[str | None, int, float]] = {}

    def read_overdue(self, host: str | None, slots: int) -> None:
        """A read of ``slots`` slots from ``host`` timed out; it holds them until it ends."""
        self._reads[host] += slots

    def read_ended(self, host: str | None, slots: int) -> None:
        """A read that :meth:`read_overdue` counted ended."""
        self._reads[host] -= slots
        if not self._reads[host]:
            del self._reads[host]

    def store_started(
        self, store: Future[TransferResult], host: str | None, slots: int, deadline: float
    ) -> None:
        """``store`` to ``host`` holds ``slots`` slots; overdue once ``deadline`` passed."""
        self._stores[store] = host, slots, deadline

    def store_ended(self, store: Future[TransferResult]) -> None:
        """``store`` (of :meth:`store_started`) resolved; unknown ones are ignored."""
        self._stores.pop(store, None)

    def overdue(self, now: float | None = None) -> Counter[str | None]:
        """The slots overdue reads and stores hold at ``now`` (``time.monotonic`` time; ``None``:
        now), by host."""
        held = Counter(self._reads)
        now = time.monotonic() if now is None else now
        for host, slots, deadline in self._stores.values():
            if deadline <= now:
                held[host] += slots
        return held

    def storing(self, now: float) -> Counter[str | None]:
        """The slots stores under way, not yet overdue at ``now`` (the time :meth:`overdue` was
        asked for: each store is in one of the two), hold, by host."""
        held: Counter[str | None] = Counter()
        for host, slots, deadline in self._stores.values():
            if deadline > now:
                held[host] += slots
        return held

    def next_due(self, seen: float) -> float:
        """When the first store under way that was not overdue at ``seen`` (the time the caller
        asked :meth:`overdue` for) turns overdue (``inf``: none will; in the
        past: one did since): a wait for a share or slots must wake then, as the host's share
        and the room change without anything ending."""
        return min((d for _, _, d in self._stores.values() if d > seen), default=math.inf)

    def room(self, held: Counter[str | None]) -> int:
        """The slots that the overdue hosts of ``held`` (from :meth:`overdue`) leave."""
        return self.size - held.total()

    def share(
        self,
        host: str | None,
        held: Counter[str | None],
        storing: Counter[str | None],
        several: bool,
    ) -> int:
        """The most slots a batch takes from ``host``: those that overdue hosts (``held``) and
        other hosts' stores under way (``storing``) leave, halved if there are ``several``
        hosts, at least one."""
        room = self.room(held) - storing.total() + storing[host]
        return max(1, room // 2 if several else room)

    def store_share(
        self, host: str | None, held: Counter[str | None], storing: Counter[str | None]
    ) -> int:
        """What :meth:`share` (of several hosts) leaves to ``host``'s next stores: less its
        stores under way."""
        return self.share(host, held, storing, True) - storing[host]


def fitting(
    holders: Sequence[str | None], share: Callable[[str | None], int], stop: Container[str | None]
) -> int:
    """How many leading ``holders`` (one host per key) a batch takes: up to the first one in
    ``stop``, or one past ``share(host)`` of one host."""
    counts: Counter[str | None] = Counter()
    limits: dict[str | None, int] = {}
    for i, host in enumerate(holders):
        counts[host] += 1
        if host in stop:
            return i
        if host not in limits:
            limits[host] = share(host)
        if counts[host] > limits[host]:
            return i
    return len(holders)
