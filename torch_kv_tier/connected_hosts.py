"""The tier's half of the ``torch-kv-tier serve`` control plane: sessions with connected hosts
(see ``connections``).

``ConnectedHosts`` is a part of ``TierManager`` (its base class, beside ``SharedHosts``) and
holds its public ``connect``/``disconnect``: a session opens in ``_connect``, a private lease
registers through its base ``private_regions`` (``_add_private``, ``add_peer``'s too) and a
shared pool through ``SharedHosts._join_shared``;
``close`` ends every session (``_end_sessions``). A connect that reaches another process
answering as a connected host's id is refused (``host_twins``). A lost session, and dialling
its host again, is that one's base ``lost_hosts.LostHosts``; telling hosts which ended
sessions resolved (fencing, client half) is its base ``session_releases.SessionReleases``.

Threading: methods without "(unlocked)" run with the manager's lock held. Handshakes and NIXL
registrations never run under it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from torch_kv_tier.connections import CONNECT_TIMEOUT_S, Dial, EitherSet, Joining
from torch_kv_tier.deferring_lock import DeferringLock
from torch_kv_tier.ended_sessions import EndedSessions
from torch_kv_tier.host_twins import twin_address, twin_problem
from torch_kv_tier.index import BlockIndex
from torch_kv_tier.private_regions import PrivateRegions
from torch_kv_tier.records import Peer
from torch_kv_tier.remote.handshake_errors import not_ready, opened_by
from torch_kv_tier.results import TIER_CLOSED
from torch_kv_tier.transport.base import DataTransport

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 120.0  # one NIXL registration of a peer's region
_JOIN_WAIT_POLL_S = 0.05  # how often a connect waiting for another one looks at ``close``


class ConnectedHosts(PrivateRegions):
    """Connected-host behaviour of ``TierManager`` (module docstring)."""

    # The manager's state this part uses (set by ``TierManager.__init__``).
    transport: DataTransport
    verify: bool
    _lock: DeferringLock
    _closed: bool
    _index: BlockIndex
    _peers: dict[str, Peer]
    _dials: dict[str, Dial]
    _joining: dict[str, Joining]  # peer id -> its connect in progress
    _removed: dict[str, Dial]
    _pending: dict[str, Dial]
    _ended: EndedSessions
    _closing: threading.Event  # set when ``close`` starts: handshakes in progress give up
    _join_turn: threading.Lock  # held by the connect whose host joins (one at a time)
    # what every handshake says of the transport's agent, read at the first (``_open``): a
    # last word of ``close`` that outlasts the transport (its wait ran out) still says it, and
    # names what it carries (a host only checks it is there: it never loads the client's agent)
    _agent_metadata: bytes | None

    if TYPE_CHECKING:  # implemented by TierManager and SharedHosts

        def _check_open(self) -> None: ...
        def _join_shared(self, session: Any, timeout_s: float) -> None: ...

    # -- public: connected hosts ---------------------------------------------------------------

    def connect(
        self,
        address: str,
        *,
        token: str | None = None,
        private: bool = False,
        slots: int | None = None,
        timeout_s: float = CONNECT_TIMEOUT_S,
        heartbeat_timeout_s: float = 10.0,
        redial_if_down: bool = False,
        dial_owner: object = None,
    ) -> str:
        """Join the shared pool of a ``torch-kv-tier serve`` host at ``HOST:PORT`` (or, with
        ``private=True``, lease up to ``slots`` of its slots for this tier alone); return its
        peer id: the host's stable id, the same in every tier (what keys are placed by). A host
        removed (``disconnect``/``remove_peer`` of its id) or whose dial is cancelled
        (``cancel_dial``) while this joins it is never connected: this raises
        ``ConnectionError`` saying it was removed, leaves no session on the host, and the host
        is not dialled again (not even with ``redial_if_down``).
        Connecting a host that is connected already returns its id (also at another address
        of it); so does a connect of a host another thread is connecting meanwhile, once that
        one succeeded. Another host process with the id of a connected one raises
        ``ValueError`` naming both addresses (hosts need distinct ``--host-id``; at the same
        address it says the host restarted and this tier has not noticed yet).

        Shared: every tier with the same config fingerprint sees the keys the others stored
        (the host's keys are known here before this returns). Raises ``HandshakeRejected`` with
        the server's reason, ``TimeoutError`` when nothing answers within ``timeout_s`` (or other
        hosts' joins, which go one at a time, hold it up that long), ``remote.UnresolvedHost``
        (a ``ConnectionError``: down, to ``redial_if_down``) at once when the host's name does
        not resolve (within ``timeout_s``). When the session is lost
        (the server stops answering heartbeats for ``heartbeat_timeout_s``, forgets the session,
        or the control connection is reset) the peer is dropped as lost and dialled again in
        the background until it answers or ``disconnect`` is called; a host with another id
        answering at its address (restarted under another ``--host-id``) joins in its place.

        ``redial_if_down``: a host that does not answer (``TimeoutError``: down, or not started
        yet), is lost while it joins (``ConnectionError``) or refuses for now
        (``HandshakeRejected`` with ``busy``: ``no free slots``, ``too many sessions``,
        ``... try again later``) is then dialled again in the background, as a lost host is
        (backoff from ``REDIAL_FIRST_S`` doubling to ``REDIAL_MAX_S``), until it joins,
        ``cancel_dial(address)`` (or ``disconnect(address)``) or ``close``; once joined it is a
        connected host like any other (``peers()`` lists it). The error is raised all the same
        (with a note saying so): the host is not connected when this returns, and its peer id is
        not known yet. Any other refusal (a bad token, block length, namespace, protocol
        version), a bad argument or a closed tier is never dialled again. ``dial_owner``: who
        asks (any hashable object, told apart by ``==``, e.g. an ``object()`` of a library's
        over the user's tier; ``TypeError`` before anything is dialled otherwise), so that
        ``cancel_dial(address, dial_owner)`` withdraws its request alone: one dial serves every
        request of an address, and holds its owners until the address joins or is cancelled.
        ``timeout_s`` below 0.1 s or ``heartbeat_timeout_s`` below 1 s raises ``ValueError``
        saying why, before anything is dialled (``quantities.CONNECT_TIMEOUT``, ...).
        """
        dial = self._new_dial(
            address, token, private, slots, timeout_s, heartbeat_timeout_s, dial_owner
        )
        try:
            return self._connect(dial)
        except Exception as exc:
            if redial_if_down and not_ready(exc) and not dial.stopped.is_set():
                self._dial_later(dial, exc, dial_owner)
            if opened_by(exc):  # sessions its handshake may have opened: released now
                self._release_for_failed_connect(dial, exc)
            raise

    def disconnect(self, peer_id: str) -> None:
        """End a connected host's session and forget it (as ``remove_peer``); given the address
        of a host ``connect(..., redial_if_down=True)`` still dials, stop dialling it. A host
        still joining (it answered) is never connected: that join has failed when this returns
        (one still running after 10 s, in NIXL, is logged as a warning), so a connect of it
        after this joins it anew."""
        self.remove_peer(peer_id)

    # -- internals ----------------------------------------------------------------------------

    def _remove(self, peer_id: str) -> None:
        """``remove_peer`` (unlocked): drop the peer, end its session clean unless a write of
        it is in flight, and stop dialling it; its ended sessions are still released. A host
        still joining (registering, or waiting for its index) has its join ended (it fails,
        never published) before this returns, so that a connect of it after this joins it
        anew."""
        with self._lock:
            self._check_open()
            dial = self._stop_dialling(peer_id)
            joining = self._joining.get(peer_id)
            session, clean = None, True
            if peer_id in self._peers:
                session, clean = self._drop_to_end(peer_id)
            elif dial is not None:  # lost and dialled again, or joining unpublished: that stops
                self._remove_from_transport(peer_id)
            elif self._cancel_pending(peer_id):  # an address dialled since its connect
                return
            else:
                raise KeyError(f"unknown peer {peer_id!r}; known: {sorted(self._peers)}")
        self._flush_then_end(session, clean, redial=True)
        if joining is not None and not joining.await_end(CONNECT_TIMEOUT_S):
            logger.warning(
                "%s: its join, ended by its removal, still runs after %g s (NIXL registering its"
                " region, say): it will not publish the host; a connect of it waits for it to end",
                peer_id,
                CONNECT_TIMEOUT_S,
            )
        if dial is not None:
            with self._lock:
                self._send_releases(dial.address)

    def _connect(self, dial: Dial) -> str:
        """Open a session with ``dial``'s host (telling it the ended sessions it may release)
        and register it; returns its peer id (unlocked). Ended sessions of that address that
        resolved, or were handed back, while it handshook or registered (no live session to
        go over then, its list taken already) go out over the new session once published."""
        with self._lock:
            self._check_open()
            release = self._ended.take(dial.address)
        session = self._open(dial, release, private=dial.private)
        peer_id = session.peer_id
        self._await_removed_join(session, dial.timeout_s)
        with self._lock:
            joining = self._joining.get(peer_id)
            known = peer_id in self._peers or joining is not None
            twin = twin_address(self._peers, peer_id, session)
            # Known before the peer is published: a session lost right after it (its I/O
            # thread drops the peer at once) is dialled again (``_end_dropped``).
            first_dial = not known and peer_id not in self._dials
            if first_dial:
                self._dials[peer_id] = dial
            if not known:  # another connect of the host waits for this one
                joined = self._joining[peer_id] = Joining(dial, first_dial)
            elif joining is None and twin is None:  # (a join does this once it succeeded)
                self._forget_replaced(peer_id, dial)
        if twin is not None:
            self._end_keeping_releases(session, True)
            raise ValueError(twin_problem(dial.address, peer_id, twin))
        if known:
            self._end_keeping_releases(session, True)
            if joining is not None:  # at another address, maybe: this one answered as it too
                try:
                    self._await_join(peer_id, joining, dial.timeout_s)
                except ConnectionError:
                    if joining.stopped.is_set():  # removed: this connect's request with it
                        dial.stopped.set()  # (not dialled again, ``redial_if_down``)
                    raise
                with self._lock:
                    self._forget_replaced(peer_id, dial)
            return str(peer_id)
        try:
            try:
                self._join(session, dial.timeout_s)
            except BaseException as exc:
                # what a connect of it waiting for this one reports
                failure = joined.failure = self._join_failure(peer_id, exc)
                if first_dial:
                    with self._lock:
                        if peer_id not in self._peers and self._dials.get(peer_id) is dial:
                            del self._dials[peer_id]
                if failure is not exc:
                    raise failure from exc
                raise
            with self._lock:
                if peer_id in self._dials:  # else removed once published: not dialled again
                    self._dials[peer_id], replaced = dial, self._dials[peer_id]
                    self._let_go(replaced)  # (a redial of it under way gives up)
                    self._moved(replaced, dial)
                self._forget_replaced(peer_id, dial)
                if dial.address in self._ended.resolved:  # handed back as it handshook
                    self._send_releases(dial.address)
        finally:
            with self._lock:
                del self._joining[peer_id]
            joined.set()
        self._redialer.arm()
        if session.lost is not None:  # lost before it was published: nobody dropped it
            self._on_session_lost(peer_id)
        return str(peer_id)

    def _join(self, session: Any, timeout_s: float) -> None:
        """Register the host of a new ``session`` (unlocked; its session ended on failure), one
        host at a time: a shared host's snapshot takes the tier's CPU (seconds at millions of
        keys), so joins side by side would each last as long as all of them, past their
        timeouts. A connect of another host (a user's, while the redialer joins a large host)
        waits too: both would take as long. Waits its turn up to ``timeout_s`` (``TimeoutError``
        naming the hosts joining meanwhile; ``RuntimeError``, nothing registered, once the tier
        is closing; ``ConnectionError`` once the host is removed, ``_stopped_join``)."""
        deadline = time.monotonic() + timeout_s
        while not self._join_turn.acquire(timeout=_JOIN_WAIT_POLL_S):
            with self._lock:
                removed = self._stopped_join(session.peer_id)
                others = sorted(set(self._joining) - {session.peer_id})
            if self._closing.is_set() or removed is not None or time.monotonic() >= deadline:
                self._end_keeping_releases(session, True)  # never published: none written
                if self._closing.is_set():
                    raise RuntimeError(TIER_CLOSED)
                if removed is not None:
                    raise removed
                raise TimeoutError(
                    f"{session.peer_id} answered, but its join waited {timeout_s} s for its turn "
                    f"behind the joins of {', '.join(others) or 'other hosts'} (a tier's joins "
                    "take turns: a shared host's index takes its CPU); connect it again, or "
                    "with a larger timeout_s"
                )
        try:
            if self._closing.is_set():  # its handshake ended as close began: register nothing
                self._end_keeping_releases(session, True)  # never published: none written
                raise RuntimeError(TIER_CLOSED)
            if session.shared:  # (a failed join ends its session itself)
                self._join_shared(session, timeout_s)
                return
            try:
                self._add_private(session.peer_id, *_region(session), session.lease, session)
            except BaseException:
                self._end_keeping_releases(session, True)  # never published: none written
                raise
        finally:
            self._join_turn.release()

    def _await_removed_join(self, session: Any, timeout_s: float) -> None:
        """A join of ``session``'s host the user removed before this connect found it (still
        running after ``disconnect`` gave up waiting for it) fails: wait for it to end
        (unlocked), so that this connect joins the host anew rather than fail with it (and not
        be dialled again). ``TimeoutError`` past ``timeout_s``, the session ended."""
        with self._lock:
            joining = self._joining.get(session.peer_id)
        if joining is None or not joining.stopped.is_set() or joining.await_end(timeout_s):
            return
        self._end_keeping_releases(session, True)
        raise TimeoutError(
            f"{session.peer_id}: a join of it that was removed still ran after {timeout_s:g} s "
            "(NIXL registering its region, say); connect it again once it ended"
        )

    def _await_join(self, peer_id: str, joined: Joining, timeout_s: float) -> None:
        """Wait (unlocked) until another thread's connect of ``peer_id`` ended: ``TimeoutError``
        when it goes on past ``timeout_s``, ``ConnectionError`` when it failed (saying at which
        address and why), ``RuntimeError`` when the tier closed meanwhile."""
        other = f"a connect of it at {joined.address} on another thread"
        deadline = time.monotonic() + timeout_s
        while not joined.wait(min(_JOIN_WAIT_POLL_S, max(deadline - time.monotonic(), 0))):
            if self._closing.is_set():
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{peer_id}: {other} did not end within {timeout_s} s")
        with self._lock:
            self._check_open()
            if peer_id in self._peers:
                return
        if joined.failure is None:
            raise ConnectionError(f"{peer_id}: {other} joined it, but it was lost or removed since")
        raise ConnectionError(
            f"{peer_id}: {other} failed: {type(joined.failure).__name__}: {joined.failure}"
        ) from joined.failure

    def _open(
        self, dial: Dial, release: list[str], *, private: bool, cancellable: bool = True
    ) -> Any:
        """A handshake with ``dial``'s host (unlocked); ``release`` goes back to be told
        again when nothing answered, with the session the host may have opened meanwhile.
        ``cancellable``: ``close``, or the dial's stop (``cancel_dial``, ``disconnect``), ends
        it while it awaits the host's answers (not so ``close``'s own last word,
        ``_end_sessions``)."""
        from torch_kv_tier.remote.client import RemoteSession
        from torch_kv_tier.remote.protocol import Region

        t = self.transport
        try:
            if self._agent_metadata is None:  # read once (see ``_agent_metadata``)
                self._agent_metadata = t.get_agent_metadata()
            return RemoteSession.open(
                dial.address,
                agent_metadata=self._agent_metadata,
                region=Region(t.base_addr, t.num_blocks, t.block_len, t.mem_type),
                config_fingerprint=t.config_fingerprint,
                token=dial.token,
                slots=dial.slots if private else None,
                on_lost=self._on_session_lost,
                timeout_s=dial.timeout_s,
                heartbeat_timeout_s=dial.heartbeat_timeout_s,
                private=private,
                release=release,
                cancel=EitherSet(self._closing, dial.stopped) if cancellable else None,
            )
        except BaseException as exc:
            release = [*release, *opened_by(exc)]
            with self._lock:  # the host may not have heard them: tell it next time
                self._ended.give_back(dial.address, release)
            raise

    def _register(
        self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int
    ) -> None:
        """Register a peer's region with the transport (unlocked: seconds for a big region,
        while lookups and transfers go on).

        Raises ``TimeoutError`` when it has not finished within ``REGISTER_TIMEOUT_S``: it is
        then abandoned (removed from the transport, which supersedes it), so that it never
        publishes a peer this tier does not know. A Ctrl-C as it waits abandons it likewise
        (then raised): the peer is not added, and adding it again works."""
        future = self.transport.add_remote_peer_async(
            peer_id, agent_metadata, base_addr, num_blocks, block_len
        )
        try:
            future.result(timeout=REGISTER_TIMEOUT_S)
        except FutureTimeout:
            self._remove_from_transport(peer_id)
            raise TimeoutError(
                f"registering {peer_id}'s region with the transport did not finish within "
                f"{REGISTER_TIMEOUT_S:g} s; it was abandoned"
            ) from None
        except KeyboardInterrupt:  # the registration goes on: abandoned, as a late one is
            self._remove_from_transport(peer_id)
            raise


def _region(session: Any) -> tuple[bytes, int, int, int]:
    """A session's host region: its agent metadata, base address, blocks and block length."""
    return session.agent_metadata, session.base_addr, session.num_blocks, session.block_len
