"""Which hosts hold the offloader's arena slots past its timeout, each host's share of a batch,
and a batch's keys by host.

A read that timed out keeps its arena slots until it ends (a host frozen past the timeout: until it
resumes, which may be never); a store keeps its slots until the tier resolves it (a frozen host:
until its session is lost, about 10 s). A host with a read or store under way for longer than the
offloader's timeout (not its restore's or offload's deadline, which a healthy host's transfer
begun late in a long call would pass) is *overdue*: a restore stops before its first key and an
offload fails its keys at once (:data:`OVERDUE`) until they end, so that it takes no more slots,
and the slots it holds are out of the *room* that batches are sized to (the free slots and
those of transfers under way: a slot that nothing will hand back is out of it too). With more
than one host, a batch takes from one host at most half the room (rounded down, at least one;
the cost: a longer run of keys on one host goes in more round trips). Transfers under way with
other hosts are out of a host's room too, and its own count against its share (an offload's
batches do not wait for each other's stores; a batch whose first key's host has no share left
waits for them).
So the first frozen host holds at most half the arena, a second one half the rest, and so on:
``k`` frozen hosts leave the other hosts' offloads and restores at least ``arena >> k`` slots
(none once that is 0: a batch always takes one slot, so that small arenas work). Other hosts'
transfers make a share smaller while they are under way (a healthy host's end at once); ``arena
/ (hosts + 1)`` would cut every batch to a third of the arena with two hosts, frozen or not.

Threading: :class:`HostShares` is not locked; its owner (``ArenaBatches``) calls it under its
own lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from concurrent.futures import Future

from torch_kv_tier.keys import Key, home_peer
from torch_kv_tier.results import TransferResult

__all__ = ["OVERDUE", "HostShares", "by_host", "fitting", "homes_among", "keys_without"]

OVERDUE = "host overdue"  # offload of a key whose host's transfers are past the timeout


class HostShares:
    """The arena slots of ``size`` that transfers under way hold, and which are overdue
    (module docstring). A look (:meth:`overdue`, :meth:`under_way`, :meth:`next_due`) costs
    what changed since the last one, not a pass over every transfer: the slots are counted by
    host as transfers start and end, and those turning overdue are taken by due time off a
    heap. The times asked for never go back (``time.monotonic`` read under the owner's lock).
    The records (``_transfers``) are the truth, changed in one step each; the counts and the
    heap only follow them, and a ``KeyboardInterrupt`` that stops a change of them midway
    (``_changing`` left set) makes the next change or look count every transfer again."""

    def __init__(self) -> None:
        # each transfer under way: its host, the slots it owns and when it is overdue
        self._transfers: dict[Future[TransferResult], tuple[str | None, list[int], float]] = {}
        self._dues: list[tuple[float, int, Future[TransferResult]]] = []  # not yet overdue
        self._pushed = itertools.count()  # ties in ``_dues`` (futures do not compare)
        self._late: set[Future[TransferResult]] = set()  # those counted overdue
        self._under_way: Counter[str | None] = Counter()  # slots by host, the others'
        self._overdue: Counter[str | None] = Counter()  # slots by host, the late ones'
        self._counted: Counter[tuple[str | None, bool]] = Counter()  # transfers: host, late
        self._looked = -math.inf  # the time last asked for
        self._changing = False  # the counts are being changed (still, after a Ctrl-C)

    def started(
        self, transfer: Future[TransferResult], host: str | None, slots: list[int], due: float
    ) -> None:
        """``transfer`` (a store, or a read its restore stopped waiting for) to or from
        ``host`` owns ``slots`` until it resolved (:meth:`settled` hands them back); overdue
        once ``due`` (``time.monotonic`` time) passed."""
        self.ended(transfer)  # a second record of it replaces the first
        self._begin()
        self._transfers[transfer] = host, slots, due
        self._count(host, len(slots), late=False, sign=1)
        heapq.heappush(self._dues, (due, next(self._pushed), transfer))
        self._changing = False

    def settled(self) -> list[tuple[Future[TransferResult], list[int]]]:
        """Drop the transfers whose futures resolved; each with the slots it owned, handed
        back once only (whoever frees them must: dropped, nothing else owns them)."""
        done = [transfer for transfer in self._transfers if transfer.done()]
        return [(transfer, self.ended(transfer)) for transfer in done]

    def ended(self, transfer: Future[TransferResult]) -> list[int]:
        """Drop the record of ``transfer``, which resolved, if :meth:`settled` has not: the
        slots it owned, handed back once only as :meth:`settled`'s are (none if it had)."""
        self._begin()
        record = self._transfers.pop(transfer, None)
        if record is None:
            self._changing = False
            return []
        host, slots, _ = record
        self._count(host, len(slots), late=transfer in self._late, sign=-1)
        self._late.discard(transfer)
        self._changing = False
        return slots

    def owned(self) -> set[int]:
        """The slots the recorded transfers own (a pass over every one)."""
        return {slot for _, slots, _ in self._transfers.values() for slot in slots}

    def held(self) -> int:
        """How many slots the recorded transfers own, from the counts (no pass over them)."""
        self._begin()  # (counts every transfer again if a Ctrl-C stopped a change midway)
        self._changing = False
        return self._under_way.total() + self._overdue.total()

    def holds(self, transfer: Future[TransferResult]) -> bool:
        """Whether ``transfer`` has a record."""
        return transfer in self._transfers

    def overdue(self, now: float | None = None) -> Counter[str | None]:
        """The slots overdue transfers hold at ``now`` (``time.monotonic`` time; ``None``:
        now), by host."""
        self._look(time.monotonic() if now is None else now)
        return Counter(self._overdue)

    def under_way(self, now: float) -> Counter[str | None]:
        """The slots transfers under way, not yet overdue at ``now`` (the time :meth:`overdue`
        was asked for: each transfer is in one of the two), hold, by host."""
        self._look(now)
        return Counter(self._under_way)

    def next_due(self, seen: float) -> float:
        """When the first transfer under way that was not overdue at ``seen`` (the time the
        caller asked :meth:`overdue` for) turns overdue (``inf``: none will; in the past: one
        did since): a wait for a share or slots must wake then, as the host's share and the
        room change without anything ending."""
        self._look(seen)
        return self._dues[0][0] if self._dues else math.inf

    def _look(self, now: float) -> None:
        """Count as overdue the transfers whose due time ``now`` (not before the last look)
        reached; drop the heap's entries of transfers that ended."""
        self._begin()
        self._looked = now = max(now, self._looked)
        dues = self._dues
        while dues and (dues[0][0] <= now or dues[0][2] not in self._transfers):
            _, _, transfer = heapq.heappop(dues)
            record = self._transfers.get(transfer)
            if record is None or transfer in self._late or record[2] > now:
                continue  # ended (or started again: its newer entry counts)
            host, slots, _ = record
            self._late.add(transfer)
            self._count(host, held := len(slots), late=False, sign=-1)
            self._count(host, held, late=True, sign=1)
        self._changing = False

    def _begin(self) -> None:
        """Before a change of the counts: count every transfer again if a Ctrl-C stopped the
        last change midway; the counts are being changed from here on (until ``_changing`` is
        cleared, in the step after the change)."""
        if self._changing:
            self._recount()
        self._changing = True

    def _recount(self) -> None:
        """Count every transfer again, as of the last look (a Ctrl-C stopped a change of the
        counts midway: they may be wrong, the records are not)."""
        transfers = self._transfers
        self._late = {t for t, (_, _, due) in transfers.items() if due <= self._looked}
        self._under_way, self._overdue, self._counted = Counter(), Counter(), Counter()
        for transfer, (host, slots, _) in transfers.items():
            self._count(host, len(slots), late=transfer in self._late, sign=1)
        late, pushed = self._late, self._pushed
        self._dues = [(d, next(pushed), t) for t, (_, _, d) in transfers.items() if t not in late]
        heapq.heapify(self._dues)
        self._changing = False

    def _count(self, host: str | None, slots: int, *, late: bool, sign: int) -> None:
        """Count one transfer of ``host`` holding ``slots`` in (``sign`` 1) or out of (-1)
        the overdue ones (``late``) or the others; a host none of whose transfers is counted
        there any more leaves that count (one with no slots stays in it)."""
        held = self._overdue if late else self._under_way
        held[host] += sign * slots
        self._counted[host, late] += sign
        if not self._counted[host, late]:
            del self._counted[host, late], held[host]

    def room(self, free: int, under_way: Counter[str | None]) -> int:
        """The slots a batch can count on: the arena's ``free`` ones and those its transfers
        ``under_way`` (from :meth:`under_way`) hold, which come back once they end; not those
        of overdue transfers, nor slots that nothing will hand back (a read that a Ctrl-C
        interrupted inside the tier's load), which a batch would wait for in vain."""
        return free + under_way.total()

    def share(
        self,
        host: str | None,
        room: int,
        under_way: Counter[str | None],
        several: bool,
    ) -> int:
        """The slots a batch may still take from ``host``: those of ``room`` (:meth:`room`)
        that other hosts' transfers under way (``under_way``) leave, halved if there are
        ``several`` hosts, at least one, less ``host``'s own transfers under way (none left
        when that is not above 0)."""
        room = room - under_way.total() + under_way[host]
        return max(1, room // 2 if several else room) - under_way[host]


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


def homes_among(keys: list[Key], peers: list[str]) -> list[str | None]:
    """Each of ``keys``'s home among ``peers`` (``None``: there are none)."""
    if len(peers) > 1:
        return [home_peer(k, peers) for k in keys]
    return [peers[0] if peers else None] * len(keys)  # the usual: one host, no per-key pass


def keys_without(
    keys: list[Key], homes: list[str | None], hosts: Container[str | None]
) -> tuple[list[Key], list[str | None]]:
    """The ``keys`` (and their ``homes``) whose homes are not among ``hosts``."""
    kept = [(k, home) for k, home in zip(keys, homes) if home not in hosts]
    return [k for k, _ in kept], [home for _, home in kept]


def by_host(
    keys: list[Key], holders: list[str | None], slots: list[int]
) -> dict[str | None, tuple[list[Key], list[int]]]:
    """``keys`` and their ``slots`` by the host each key is read from (``holders``)."""
    if len(set(holders)) == 1:  # the usual: one host, no per-key pass
        return {holders[0]: (keys, slots)}
    reads: dict[str | None, tuple[list[Key], list[int]]] = {}
    for key, host, slot in zip(keys, holders, slots, strict=True):
        host_keys, host_slots = reads.setdefault(host, ([], []))
        host_keys.append(key)
        host_slots.append(slot)
    return reads
