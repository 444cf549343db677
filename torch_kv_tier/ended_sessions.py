"""``EndedSessions``: the client half of fencing, the tier's count of ended sessions' writes.

A session that ended while writes of it were in flight (or ended without a clean disconnect at
all) is held by its server: the server gives its slots to nobody until the client releases it.
The tier counts each ended session's writes still in flight; once the transport reported the last
one, the session is *resolved*, and its id goes to the server with the next session's handshake
or with a ``Release`` on a live session (``session_releases``).

Threading: ``EndedSessions`` is plain state the manager mutates under its lock. Failure model:
none of its own (no I/O); a session it never hears the last write of stays held by its server,
which is safe.
"""

from __future__ import annotations

from typing import Any


class EndedSessions:
    """Sessions that ended with writes possibly in flight, until their server is told."""

    def __init__(self) -> None:
        self._writes: dict[Any, int] = {}  # ended session -> its writes still in flight
        self.resolved: dict[str, list[str]] = {}  # address -> session ids to release
        # address -> release threads carrying sessions they took there, and dropped sessions
        # whose end (which may hand some back) is under way or due (``session_releases``)
        self.carrying: dict[str, int] = {}
        self._ending: dict[int, Any] = {}  # id -> those dropped sessions (``end_begins``)

    def ended(self, session: Any, writes_in_flight: int) -> None:
        """``session`` ended with ``writes_in_flight`` writes the transport still holds."""
        if writes_in_flight:
            self._writes[session] = writes_in_flight
        else:
            self.resolved.setdefault(session.address, []).append(session.session_id)

    def write_resolved(self, session: Any) -> bool:
        """The transport reported a write of an ended ``session``; ``True`` when it was the
        last one (the session is resolved)."""
        left = self._writes.get(session)
        if left is None:
            return False
        if left > 1:
            self._writes[session] = left - 1
            return False
        del self._writes[session]
        self.resolved.setdefault(session.address, []).append(session.session_id)
        return True

    def forget(self, session: Any) -> None:
        """``session``, resolved, ended clean on its host (it said so): nothing to release."""
        ids = self.resolved.get(session.address, [])
        if session.session_id in ids:
            ids.remove(session.session_id)
            if not ids:
                del self.resolved[session.address]

    def give_back(self, address: str, session_ids: list[str]) -> None:
        """Sessions ``take`` returned that the host may not have heard of: tell it later."""
        if session_ids:
            self.resolved.setdefault(address, []).extend(session_ids)

    def take(self, address: str, *, closing: bool = False) -> list[str]:
        """The resolved sessions of ``address``, to tell its server (now forgotten here), but
        those still ending (``end_begins``), kept until they ended; ``closing`` (``close``'s
        last word): all of them, since an end that outlasts ``close`` finds the transport
        closed and can name nothing then (a host told first ends such a session itself, and
        its disconnect goes unanswered: nothing lost)."""
        ids = self.resolved.pop(address, [])
        if closing:
            return ids
        ending = {s.session_id for s in self._ending.values() if s.address == address}
        kept = [sid for sid in ids if sid in ending]
        if kept:
            self.resolved[address] = kept
            return [sid for sid in ids if sid not in ending]
        return ids

    def end_begins(self, session: Any) -> None:
        """A dropped ``session``'s end is due or under way: counted as carrying to its host
        (the end may hand releases back), and not named as resolved (``take``) until it
        ended (``end_ends``): a host told to release a session it still counts live ends it
        first, and the session's own disconnect then goes unanswered."""
        self._ending[id(session)] = session
        self.carry(session.address, 1)

    def end_ends(self, session: Any) -> None:
        """``session``'s end is over (or ``close`` ends it itself); once only."""
        if self._ending.pop(id(session), None) is not None:
            self.carry(session.address, -1)

    def ending(self, address: str) -> bool:
        """Whether a dropped session of ``address`` is still ending (``end_begins``)."""
        return any(s.address == address for s in self._ending.values())

    def holds(self, address: str) -> bool:
        """Whether a session of ``address`` is still to be released (resolved or not, or
        being carried there)."""
        return (
            address in self.resolved
            or address in self.carrying
            or any(s.address == address for s in self._writes)
        )

    def carry(self, address: str, delta: int) -> None:
        """A release thread, or a dropped session's end, starts (``delta`` 1) or stops (-1)
        carrying sessions to ``address``."""
        left = self.carrying.get(address, 0) + delta
        if left:
            self.carrying[address] = left
        else:
            del self.carrying[address]

    @property
    def unresolved(self) -> int:
        return len(self._writes)
