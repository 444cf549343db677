"""``HeldSlots``: the slots of ended sessions whose client may still write them (fencing).

A session that ends without a clean disconnect (no heartbeat for the lease timeout, a
disconnect with writes in flight, a frame the host could not queue for it) may still write its
slots: a write in flight, or a writer frozen mid-write. Those slots are *held*: nobody else gets
them until the session's client releases it (``release``), which it does once its transport
reported every write of the session resolved, or the operator's ``--hold-timeout`` passes
(``since``) while the host listens (``pause``): a host that stalled read none of the releases,
nor the heartbeats that tell a client its session ended, and a write in flight to it may land
only once it resumes. A private session holds its lease (``LeaseTable``), a shared one its
uncommitted grants (``SharedCache``): a hold is bounded by those, not by a guess at how long a
freeze lasts.

Pure bookkeeping (no I/O, no clock of its own: callers pass ``now``). Not thread-safe: the
server guards each one with its state lock, as the table or cache that keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

Slots = TypeVar("Slots", bound=Sequence[int])


class HeldSlots(Generic[Slots]):
    """Ended sessions' held slots (a ``range`` lease, or a list of granted slots) and since
    when they are held, by session id."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Slots, float]] = {}

    def hold(self, session_id: str, slots: Slots, now: float) -> None:
        """``session_id`` ended at ``now`` and may still write ``slots``."""
        self._held[session_id] = (slots, now)

    def release(self, session_ids: Iterable[str], give_back: Callable[[Slots], None]) -> int:
        """Ended sessions whose client reported every write resolved: each one's held slots go
        to ``give_back``. Unknown ids are ignored (only the client knows a session's id).
        Returns the number of slots freed."""
        freed = 0
        for sid in session_ids:
            held = self._held.pop(sid, None)
            if held is not None:
                give_back(held[0])
                freed += len(held[0])
        return freed

    def since(self, before: float) -> list[str]:
        """Ended sessions held since before ``before`` (for an operator's hold timeout)."""
        return [sid for sid, (_, since) in self._held.items() if since < before]

    def pause(self, seconds: float, now: float) -> None:
        """The host read no control message for ``seconds`` before ``now`` (its loop stalled):
        every hold's time starts that much later (at most at ``now``), as a session's silence
        does (``LeaseTable.pause``)."""
        for sid, (slots, since) in self._held.items():
            self._held[sid] = (slots, min(since + seconds, now))

    def __len__(self) -> int:
        """Ended sessions holding slots."""
        return len(self._held)

    @property
    def blocks(self) -> int:
        """Slots held."""
        return sum(len(slots) for slots, _ in self._held.values())
