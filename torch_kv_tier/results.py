"""What a tier reports: per-call results, counters and index events."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from torch_kv_tier.keys import Key

# Reasons a key can fail, as found in ``TransferResult.failed``.
MISSING = "missing"  # load of a key that is not stored, or whose bytes failed their digest
CAPACITY = "capacity"  # store with no free or evictable remote slot
TRANSFER_FAILED = "transfer failed"  # the transport reported an error
PEER_LOST = "peer lost"  # the key's peer was removed, disconnected or died
CLOSED = "closed"  # the tier closed before the transfer finished
# a load whose read was still in flight transfer_timeout_s after its post (its peer is dropped):
# the read may still land, so its blocks stay withheld until stats().late_reads no longer counts
# it (the tier refuses loads into them and stores from them meanwhile; do not reuse them)
TIMED_OUT = "timed out"
NO_PEERS = "no peers"  # store with no peer registered
# what a call of a closed tier raises (``RuntimeError``): the tier cannot be opened again
TIER_CLOSED = "TierManager is closed: create a new one (TierManager.create) to go on"


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one ``store`` or ``load`` call.

    ``keys`` lists the keys that succeeded in call order; ``failed`` maps each other key to its
    reason; ``nbytes`` counts the bytes this call moved; ``seconds`` is submit-to-done time.
    """

    ok: bool
    keys: list[Key]
    failed: dict[Key, str]
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class TierEvent:
    """A change of the index: a key became loadable (``stored``) or stopped being loadable."""

    kind: Literal["stored", "evicted", "discarded", "lost"]
    key: Key
    peer_id: str


@dataclass(frozen=True)
class PeerStats:
    capacity: int  # slots of the peer (or of its lease) this tier may use
    used: int  # slots holding a stored key or a write in flight
    keys: int  # stored keys


@dataclass(frozen=True)
class TierStats:
    blocks_stored: int = 0
    bytes_stored: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    evictions: int = 0
    inflight: int = 0  # transfers submitted to the transport and not finished
    queued: int = 0  # transfers waiting for an in-flight slot
    keys: int = 0  # stored keys over all peers
    latency_p50_us: float = 0.0  # per-transfer completion latency over recent transfers
    latency_p99_us: float = 0.0
    events_dropped: int = 0  # events discarded because nobody called take_events
    verify_failed: int = 0  # blocks read whose bytes did not match their key's digest: "missing"
    unreleased_sessions: int = 0  # ended sessions whose writes the transport still holds
    peers_dropped: int = 0  # peer registrations dropped (failed, lost, removed or replaced)
    stranded_reads: int = 0  # failed reads that may still land: their loads resolve at close
    # reads past transfer_timeout_s the transport still holds: their loads settled "timed out",
    # their blocks withheld (refused to loads and stores) until it reports them or closes
    late_reads: int = 0
    # the peers ``peers()`` lists (joined), by id; a host still joining is in neither
    peers: dict[str, PeerStats] = field(default_factory=dict)
    # hosts whose join is under way (a connect or redial: answered, registering or awaiting
    # their index; a shared one already takes stores, ``placing_peers()``)
    peers_joining: int = 0


class Counters:
    """A tier's running totals, mutated under its lock; ``latencies_us`` keeps the per-transfer
    completion latencies of the last ``window`` transfers."""

    __slots__ = (
        "blocks_loaded",
        "blocks_stored",
        "latencies_us",
        "peers_dropped",
        "transfers_done",
        "transfers_failed",
        "verify_failed",
    )

    def __init__(self, window: int = 4096) -> None:
        self.blocks_stored = self.blocks_loaded = 0
        self.transfers_done = self.transfers_failed = 0
        self.verify_failed = self.peers_dropped = 0
        self.latencies_us: deque[float] = deque(maxlen=window)

    def stats(self, block_len: int, **gauges: Any) -> TierStats:
        """These totals as ``TierStats``, with the ``gauges`` (the tier's other fields) added."""
        p50, p99 = self.latency_percentiles_us()
        return TierStats(
            blocks_stored=self.blocks_stored,
            bytes_stored=self.blocks_stored * block_len,
            blocks_loaded=self.blocks_loaded,
            bytes_loaded=self.blocks_loaded * block_len,
            transfers_done=self.transfers_done,
            transfers_failed=self.transfers_failed,
            latency_p50_us=p50,
            latency_p99_us=p99,
            verify_failed=self.verify_failed,
            peers_dropped=self.peers_dropped,
            **gauges,
        )

    def latency_percentiles_us(self) -> tuple[float, float]:
        """p50 and p99 of the recent latencies (0 before the first transfer)."""
        lat = np.asarray(self.latencies_us) if self.latencies_us else np.zeros(1)
        return float(np.percentile(lat, 50)), float(np.percentile(lat, 99))
