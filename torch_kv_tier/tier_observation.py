"""The calls that report on the tier and move no block: ``stats`` (its counters and gauges
now) and ``take_events`` (its index's changes since the last call, taken: the next call
returns only later ones).

``Observation`` is a part of ``TierManager`` (a base class, beside ``Closing``,
``Transfers``, ``SharedHosts``, ``ConnectedHosts`` and ``KeyQueries``). Threading: any thread;
each call reads the manager's tables under its lock, and none waits on the network. Each
returns a snapshot the caller owns (a later change of the tier leaves it as it was), also on a
closed tier.
"""

from __future__ import annotations

from torch_kv_tier.connections import Joining
from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.ended_sessions import EndedSessions
from torch_kv_tier.index import BlockIndex
from torch_kv_tier.records import Op, Peer
from torch_kv_tier.results import Counters, PeerStats, TierEvent, TierStats
from torch_kv_tier.withheld import WithheldReads


class Observation:
    """``TierManager``'s reports on itself (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    _lock: DeferringLock
    _block_len: int
    _counters: Counters
    _index: BlockIndex
    _ops: dict[int, Op]
    _peers: dict[str, Peer]
    _joining: dict[str, Joining]
    _ended: EndedSessions
    _withheld: WithheldReads

    def stats(self) -> TierStats:
        """The tier's counters and gauges now (``TierStats``): ``peers`` has the peers
        ``peers()`` lists (joined), ``peers_joining`` counts the hosts still joining. Any
        thread."""
        with self._lock:
            return self._counters.stats(
                self._block_len,
                evictions=self._index.evictions,
                inflight=len(self._ops),
                queued=sum(len(p.queue) for p in self._peers.values()),
                keys=self._index.key_count,
                events_dropped=self._index.events_dropped,
                unreleased_sessions=self._ended.unresolved,
                stranded_reads=len(self._withheld.stranded),
                late_reads=self._withheld.late,
                peers={
                    pid: PeerStats(p.slots.capacity, p.slots.used, p.slots.stored)
                    for pid, p in self._peers.items()
                    if pid not in self._joining
                },
                peers_joining=len(self._joining),
            )

    def take_events(self) -> list[TierEvent]:
        """Index changes since the last call, oldest first (at most the newest 100,000).

        Events are recorded only by a tier built with ``events=True``; otherwise this is
        always empty (a tier nobody drains pays nothing for them).
        """
        with self._lock:
            return [TierEvent(*e) for e in self._index.take_events()]  # type: ignore[arg-type]
