"""Sessions and leases: who is connected, and which contiguous range of the server's slots
each private client may use (a shared session leases nothing: see ``shared_cache``).

Pure bookkeeping (no I/O, no clock of its own: callers pass ``now``), so it is tested directly.
Not thread-safe: the server guards a ``LeaseTable`` with its state lock.
"""

from __future__ import annotations

import itertools
import numbers
import operator
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from torch_kv_tier.remote.held_slots import HeldSlots


class SlotPool:
    """Free slots of ``[0, num_blocks)`` as sorted, disjoint, coalesced ``[start, stop)`` runs.

    The runs are numpy arrays, each operation one numpy pass over them: a pool fragmented into
    hundreds of thousands of runs (a shared pool's scattered free slots, given back for a
    private lease) cost the host's loop 0.1 s of Python per draw and 20 ms per ``free``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._starts = np.array([0], dtype=np.int64)
        self._stops = np.array([num_blocks], dtype=np.int64)
        self._free = num_blocks

    @property
    def free(self) -> int:
        """Number of free slots."""
        return self._free

    def take(self, want: int) -> range | None:
        """Lease up to ``want`` slots as one range; ``None`` when nothing is free.

        Best fit: the smallest free run that holds ``want`` slots, else the largest run (a
        partial grant); the first such run on a tie. ``want`` is an integer (a numpy one is
        taken as a Python ``int``, so the pool's counts and ranges stay Python ints).
        """
        want = operator.index(want)
        if want <= 0:
            raise ValueError(f"want must be > 0, got {want}")
        if not self._free:
            return None
        lengths = self._stops - self._starts
        fitting = lengths >= want
        if fitting.any():
            i = int(np.argmin(np.where(fitting, lengths, self.num_blocks + 1)))
        else:
            i = int(np.argmax(lengths))
        start, length = int(self._starts[i]), int(lengths[i])
        grant = min(want, length)
        if grant == length:
            self._starts = np.delete(self._starts, i)
            self._stops = np.delete(self._stops, i)
        else:
            self._starts[i] += grant
        self._free -= grant
        return range(start, start + grant)

    def give_back(self, lease: range) -> None:
        """Return a range obtained from ``take``; raise ``ValueError`` if any slot is free."""
        start, stop = lease.start, lease.stop
        if not 0 <= start < stop <= self.num_blocks:
            raise ValueError(f"lease {lease} is outside [0, {self.num_blocks})")
        self._merge(np.array([start]), np.array([stop]), f"lease {lease}")

    def give_back_slots(self, slots: Sequence[int]) -> None:
        """Return taken ``slots``, in any order, in one pass. Raises, the pool unchanged,
        ``TypeError`` unless every slot is an int (numpy's too; not a bool, a float or a str:
        ``1.7`` was taken as slot 1), and ``ValueError`` if any is outside the pool, free, or
        named twice."""
        if not len(slots):
            return
        if not all(map(_is_int, set(map(type, slots)))):  # C passes, as ``bad_keys``'s
            odd = next(s for s in slots if not _is_int(type(s)))
            raise TypeError(
                f"slots must be ints (numpy's too), got {odd!r} (a {type(odd).__name__}): "
                "pass int() of each"
            )
        try:
            at = np.sort(np.fromiter(slots, np.int64, len(slots)))
        except OverflowError:  # an int past 64 bits: no slot of any pool
            raise ValueError(f"slots reach outside [0, {self.num_blocks})") from None
        if at[0] < 0 or at[-1] >= self.num_blocks:
            raise ValueError(
                f"slots {int(at[0])} to {int(at[-1])} reach outside [0, {self.num_blocks})"
            )
        breaks = np.flatnonzero(np.diff(at) != 1) + 1
        starts = at[np.concatenate(([0], breaks))]
        stops = at[np.concatenate((breaks - 1, [len(at) - 1]))] + 1
        self._merge(starts, stops, f"{len(at)} slots")

    def _merge(self, starts: np.ndarray, stops: np.ndarray, what: str) -> None:
        """Add the sorted, taken runs ``[starts, stops)``, coalescing adjacent runs; the pool
        is unchanged when one overlaps another or a free one."""
        at = np.searchsorted(self._starts, starts)
        all_starts = np.insert(self._starts, at, starts)
        all_stops = np.insert(self._stops, at, stops)
        if np.any(all_starts[1:] < all_stops[:-1]):
            raise ValueError(f"{what} overlaps free slots: returned twice?")
        apart = all_starts[1:] != all_stops[:-1]
        self._starts = all_starts[np.concatenate(([True], apart))]
        self._stops = all_stops[np.concatenate((apart, [True]))]
        self._free += int((stops - starts).sum())


def _is_int(kind: type) -> bool:
    """Whether ``kind`` is an integer type (numpy's too), ``bool`` not."""
    return issubclass(kind, numbers.Integral) and kind is not bool


@dataclass
class Session:
    """One connected client and its lease (empty for a shared session).

    ``session_id`` is the client's secret handle (never shown in stats); ``public_id`` names
    the session in logs and stats; ``identity`` is its control socket's routing id (where the
    server pushes events). Byte counters are the client's own cumulative reports.
    """

    session_id: str
    public_id: str
    client_name: str
    lease: range
    started: float
    last_seen: float
    bytes_written: int = 0
    bytes_read: int = 0
    slots_used: int = 0
    shared: bool = False
    namespace: str = ""
    identity: bytes = b""


class LeaseTable:
    """Sessions, their leases, and expiry after ``lease_timeout_s`` without a heartbeat.

    ``max_lease`` caps every lease; a client asking for no particular number gets that cap
    (or the largest free run, if smaller). At most ``max_sessions`` sessions are open at once.

    Fencing: a private lease whose session ends without a clean disconnect (expired, or closed
    with writes in flight) is *held* (``held``: ``held_slots``): its client may still write it,
    so it goes back to the pool only when that client releases the session (``release``), never
    on a timer of its own.
    """

    def __init__(
        self,
        num_blocks: int,
        lease_timeout_s: float,
        max_lease: int | None = None,
        max_sessions: int = 1024,
    ):
        if lease_timeout_s <= 0:
            raise ValueError(f"lease timeout must be > 0 s, got {lease_timeout_s}")
        cap = num_blocks if max_lease is None else max_lease
        if not 0 < cap <= num_blocks:
            raise ValueError(f"max lease must be in [1, {num_blocks}], got {max_lease}")
        if max_sessions <= 0:
            raise ValueError(f"max sessions must be > 0, got {max_sessions}")
        self.pool = SlotPool(num_blocks)
        self.lease_timeout_s = lease_timeout_s
        self.max_lease = cap
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}
        self.held: HeldSlots[range] = HeldSlots()  # ended sessions' leases
        self.reclaimed = 0  # leases taken back after a missed heartbeat deadline
        self.retired_bytes_written = 0  # reported by sessions that have ended
        self.retired_bytes_read = 0
        self._public_ids = itertools.count(1)

    def open(
        self,
        client_name: str,
        slots: int | None,
        now: float,
        *,
        private: bool = True,
        session_id: str | None = None,
    ) -> Session | None:
        """Start a session; a private one leases up to ``slots`` slots, a shared one leases
        none. ``None`` when no slot is free or ``max_sessions`` are open. ``session_id``: the
        secret the client knows it by (default: a random one); it must be new."""
        if len(self.sessions) >= self.max_sessions:
            return None
        if private:
            lease = self.pool.take(min(slots or self.max_lease, self.max_lease))
            if lease is None:
                return None
        else:
            lease = range(0)
        session = Session(
            session_id=session_id or secrets.token_hex(16),
            public_id=f"s{next(self._public_ids)}",
            client_name=client_name,
            lease=lease,
            started=now,
            last_seen=now,
            shared=not private,
        )
        self.sessions[session.session_id] = session
        return session

    def touch(self, session_id: str, now: float) -> Session | None:
        """Record a sign of life; ``None`` for an unknown (or already expired) session."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.last_seen = now
        return session

    def close(self, session_id: str, now: float, *, clean: bool) -> Session | None:
        """End a session; its lease is free at once when ``clean`` (no write in flight), else
        held. ``None`` if it was unknown."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self._retire(session, now, clean=clean)
        return session

    def pause(self, seconds: float, now: float) -> None:
        """The host read no control message for ``seconds`` before ``now`` (its loop stalled:
        frozen, or busy): a session's silence counts only while the host listens, so its last
        sign of life moves that much later (at most to ``now``). Its heartbeats of that time
        are still queued, and may be read only after the next ``expire``."""
        for session in self.sessions.values():
            session.last_seen = min(session.last_seen + seconds, now)

    def expire(self, now: float) -> list[Session]:
        """End every session silent for longer than the lease timeout (their leases are held);
        return them."""
        late = [s for s in self.sessions.values() if now - s.last_seen > self.lease_timeout_s]
        for session in late:
            del self.sessions[session.session_id]
            self._retire(session, now, clean=False)
        self.reclaimed += len(late)
        return late

    def release(self, session_ids: list[str]) -> int:
        """Ended sessions whose client reported every write resolved: their held leases go
        back to the pool (unknown ids are ignored). Returns the number of slots freed."""
        return self.held.release(session_ids, self.pool.give_back)

    @property
    def leased(self) -> int:
        """Slots currently leased."""
        return self.pool.num_blocks - self.pool.free

    def _retire(self, session: Session, now: float, *, clean: bool) -> None:
        if session.lease:
            if clean:
                self.pool.give_back(session.lease)
            else:
                self.held.hold(session.session_id, session.lease, now)
        self.retired_bytes_written += session.bytes_written
        self.retired_bytes_read += session.bytes_read
