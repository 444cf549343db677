"""``NixlInflight``: the transfers a ``NixlTransport`` posted and has not reported yet, from the
post to the release of their handles.

Failure model (vLLM 0.33's, see ``base.py`` and ``faults.py``). A transfer whose state check raises
faults its (still published) peer once and stays in flight: a WRITE may keep landing after its
handle raised, so only a remote disconnect (the target endpoint is gone) ends it. A handle is
released only once its transfer is over, or when the owner asks (``cancel(mode="immediate")``,
``release_all``): NIXL's UCX backend frees its requests without stopping them (a WRITE was measured
to keep landing), so the transfer may run on until the agent is destroyed. A post that fails after
NIXL created the request with a remote disconnect marks the agent unsafe to destroy
(``agent_lifetime``): one kept so, with a transfer released that way, may write into the region for
as long as the process lives (``quiet`` is then False).

Fenced failures. A transfer that NIXL reports failed without a remote disconnect (its post
raised or returned ``ERR`` after the request was created, its state is ``ERR``, or its state
check raised) may still be on the wire: NIXL's UCX backend posts one RMA operation per block and,
when one fails, frees the others without stopping them; a WRITE was measured to keep landing after
its check raised. So it is not reported failed (nor, for a post, refused with ``None``) until a
*fence* proved it over: the same operation on its first block pair only, posted after the failure
(a READ into its own first local block, withheld like the others; a WRITE of its own first block
to its own first slot, which its caller keeps fenced until the report). NIXL's UCX backend ends
every transfer with a flush of its endpoint, and with no split (``ucx_env``) every transfer to a
remote agent runs on that agent's one endpoint of the shared worker, so the fence reaching
``DONE`` proves that every operation posted to that peer before it ended, the failed one's
included; a fence failing with a remote disconnect proves it too (the endpoint failed and UCX
completed all its operations), and faults the peer like any disconnect. A fence failing
otherwise strikes the peer and is posted again by a later poll (``FENCE_RETRY_S``); the
transfer stays in flight meanwhile, and ``cancel(mode="immediate")`` or closing still release
it. Never given up: a transfer reported failed has its blocks reused and its slots handed on by
its caller, where a write still landing would overwrite them; the peer's strikes fault it, and
its caller drops it. A peer's first refused fence since one went through is logged as a
warning, the others at debug level, and one line says when one goes through again. A fenced
transfer's peer is faulted (or struck, for a state ``ERR``) when it failed: a post that failed
part-way faults it at once, since its caller (the tier drops a peer that refused a post) learns
of the failure only once it is fenced. So every failure this transport reports is final:
nothing of that transfer lands later. Without fences (``fence=False``: vLLM 0.33's contract
exactly, what its own test suite asserts) a failure is reported at once and a failed post
refused with ``None``, their handles released while other blocks may run (on a kept agent the
region is then never ``quiet``).

Threading: no lock of its own. Every method expects the caller to hold the transport's lock,
which also guards ``NixlPeers`` and ``PeerHealth`` (the tables this one updates).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch_kv_tier.transport import agent_lifetime
from torch_kv_tier.transport.base import CancelMode, PollResult
from torch_kv_tier.transport.faults import PeerHealth, ends_transfer
from torch_kv_tier.transport.nixl_peers import NixlPeer, NixlPeers

# The transport's logger: these lines are the transport's (``NixlTransport <name>: ...``).
logger = logging.getLogger("torch_kv_tier.transport.nixl")

# A fence refused without a disconnect is posted again after this long, doubled at each refusal
# up to the most: a dead peer's listener refuses one connect() per post (and UCX logs each), for
# as long as the tier lives. When it is posted again changes only when the transfer ends.
FENCE_RETRY_S = (0.05, 30.0)
_GONE = "GONE"  # pseudo-state: the check raised a remote disconnect, the transfer is over
_RUNNING = ("PROC", "PEND", None)  # may still write (``None``: the check raised, see above)


@dataclass(eq=False)
class _Transfer:
    peer: NixlPeer
    handle: Any  # ``None`` once a failed post's request was released
    op: str
    local_dlist: Any
    fence_pair: tuple[int, int]  # (local, remote) block a fence reads: the transfer's first pair
    struck: bool = False  # already counted against its peer (a raising check counts once)
    fencing: bool = False  # failed without a disconnect: reported once fenced
    fence: Any = None  # the fence's handle while one is posted
    fence_wait: float = 0.0  # after a refused fence: how long until the next (``FENCE_RETRY_S``)
    fence_due: float = 0.0  # monotonic time of the next fence


class NixlInflight:
    """In-flight transfers by id (module docstring); the agent is ``peers.agent``."""

    def __init__(
        self, owner: str, peers: NixlPeers, health: PeerHealth, *, fence: bool = True
    ) -> None:
        self._owner = owner  # the transport's name, for logs
        self._peers = peers
        self._health = health
        self._fence = fence  # False: vLLM 0.33's failure semantics, no fences (module docstring)
        self._transfers: dict[int, _Transfer] = {}
        self._ids = itertools.count(1)
        self._kept_until_exit = False  # see agent_lifetime
        self._released_early = False  # a transfer was released before it was seen over
        # peers whose fences NIXL refused since one last went through: how many (logged once)
        self._refused: dict[NixlPeer, int] = {}

    @property
    def quiet(self) -> bool:
        """Whether nothing may write into the region once the agent is released: False when a
        transfer was released while it may still run (``cancel(mode="immediate")`` or
        ``release_all`` of one not seen over, a failure reported without a fence) and the agent
        is kept until exit, so never destroyed (module docstring)."""
        return not (self._kept_until_exit and self._released_early)

    def __len__(self) -> int:
        return len(self._transfers)

    def __iter__(self) -> Iterator[int]:
        """The ids in flight (a snapshot is the caller's to take)."""
        return iter(self._transfers)

    def post(
        self, op: str, local_dlist: Any, local: Sequence[int], peer: NixlPeer, remote: Sequence[int]
    ) -> int | None:
        """Post ``op`` ("WRITE" or "READ") between prepared block indices; its id, or ``None``
        when NIXL refused or raised (logged, and counted against the peer) before anything could
        be sent. A post that failed after NIXL created it gets an id all the same: it is
        reported failed once fenced (module docstring)."""
        handle, posted = self._start(op, local_dlist, local, peer.dlist, remote)
        xfer = _Transfer(peer, handle, op, local_dlist, (local[0], remote[0]))
        if isinstance(posted, Exception):
            logger.warning(
                "NixlTransport %s: %s to %s failed: %s", self._owner, op, peer.peer_id, posted
            )
            gone = self._ends(peer, posted)
            fenced = self._fence and handle is not None and not gone
            if fenced:  # its caller learns of it only once fenced: a peer not to use meanwhile
                self._health.fault(peer.peer_id, f"a {op} failed part-way: {posted}")
            else:
                self._health.raised(peer.peer_id, posted)
            if handle is not None:  # NIXL failed the request: it holds nothing of it
                self._release_handle(-1, handle)
                self._released_early |= not fenced and not gone
            if not fenced:
                return None
            xfer.handle, xfer.struck, xfer.fencing = None, True, True
        tid = next(self._ids)
        self._transfers[tid] = xfer
        peer.inflight.add(tid)
        return tid

    def poll(self, peer_id: str | None) -> PollResult:
        """Report and release the transfers that are over (all, or ``peer_id``'s).

        Successes in the batch reset a peer's strikes before its failures count, whatever the
        order the transfers were checked in; ``peer_fault`` is set on a faulted peer's poll.
        """
        done: list[int] = []
        failed: list[int] = []
        succeeded: set[NixlPeer] = set()
        failures: list[tuple[NixlPeer, str]] = []
        for tid, xfer in self._transfers.items():
            if peer_id is not None and xfer.peer.peer_id != peer_id:
                continue
            state = self._state(tid, xfer)
            if state == "DONE":
                done.append(tid)
                succeeded.add(xfer.peer)
            elif state not in _RUNNING:
                failed.append(tid)
                self._released_early |= state != _GONE and not self._fence  # no fence proved it
                if not xfer.struck:
                    failures.append((xfer.peer, f"state {state}"))
        for peer in succeeded:
            if self._peers.is_published(peer):
                self._health.succeeded(peer.peer_id)
        for peer, cause in failures:
            if self._peers.is_published(peer):
                self._health.failed(peer.peer_id, cause)
        for tid in itertools.chain(done, failed):
            self._forget(tid, release=True)
        fault = self._health.faults.get(peer_id) if peer_id is not None else None
        return PollResult(done or (), failed or (), fault)

    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode) -> list[int]:
        """Release the given transfers; the ids still in flight (``"wait"`` only).

        ``"wait"`` checks each transfer's state first: UCX frees a handle even while its WRITE
        still runs, so a ``PROC``/``PEND`` transfer is never released here. A raising check
        faults the peer and keeps the transfer, except after a remote disconnect, which drops
        it; a failed transfer is kept until fenced. A release that raises keeps it too.
        """
        still: list[int] = []
        for tid in transfer_ids:
            xfer = self._transfers.get(tid)
            if xfer is None:
                continue
            if mode == "immediate":
                self._release_early(tid, xfer)
                continue
            state = self._state(tid, xfer)
            if state in _RUNNING:
                still.append(tid)
                continue
            if state == _GONE or xfer.fencing:  # nothing more lands; the handle may not release
                self._forget(tid, release=True)
                continue
            try:
                self._peers.agent.release_xfer_handle(xfer.handle)
            except Exception as exc:
                logger.debug("NixlTransport %s: transfer %d draining: %s", self._owner, tid, exc)
                still.append(tid)
                continue
            self._forget(tid, release=False)
        return still

    def release_all(self) -> None:
        """Release every handle (the transport is closing)."""
        for tid, xfer in list(self._transfers.items()):
            self._release_early(tid, xfer)

    def _release_early(self, tid: int, xfer: _Transfer) -> None:
        """Release a transfer its owner gives up on, noting whether it may still run (``quiet``):
        not once its state is ``DONE`` or a remote disconnect ended it (a transfer over but not
        polled yet at close withheld a kept agent's region for good). Posts no fence."""
        if not self._released_early:
            self._released_early = xfer.fencing or not self._over(xfer)
        self._forget(tid, release=True)

    def _over(self, xfer: _Transfer) -> bool:
        """Whether ``xfer``'s state proves that nothing more of it lands (``DONE``, or a check
        raising a remote disconnect); no side effect (a check raising otherwise: False)."""
        try:
            return str(self._peers.agent.check_xfer_state(xfer.handle)) == "DONE"
        except Exception as exc:
            return ends_transfer(exc)

    def _start(
        self, op: str, local_dlist: Any, local: Sequence[int], dlist: Any, remote: Sequence[int]
    ) -> tuple[Any, str | Exception]:
        """Create and post one NIXL transfer: its handle (``None`` when creation failed) and
        its posted state, or the error. A post that fails with a remote disconnect after the
        request was created marks the agent unsafe to destroy (``agent_lifetime``)."""
        agent = self._peers.agent
        handle = None
        try:
            handle = agent.make_prepped_xfer(op, local_dlist, local, dlist, remote)
            state = str(agent.transfer(handle))
            if state == "ERR":
                raise RuntimeError("NIXL refused to post the transfer (state ERR)")
        except Exception as exc:
            posted = handle is not None and agent_lifetime.is_post_disconnect(exc)
            if posted and not self._kept_until_exit:  # UCX may still hold a request NIXL freed
                self._kept_until_exit = True
                agent_lifetime.keep_until_exit(agent, self._owner)
            return handle, exc
        return handle, state

    def _state(self, tid: int, xfer: _Transfer) -> str | None:
        """``_checked_state``, except for a transfer that failed without a disconnect: running
        (``None``) until a fence proved it over, then ``"ERR"`` (module docstring)."""
        if not xfer.fencing:
            state = self._checked_state(tid, xfer)
            if not self._fence or state in ("DONE", "PROC", "PEND", _GONE):
                return state
            xfer.fencing = True
        return "ERR" if self._fenced(tid, xfer) else None

    def _fenced(self, tid: int, xfer: _Transfer) -> bool:
        """Whether ``xfer``'s fence proved it over; posts the fence when none runs. A fence that
        failed with a disconnect faults the (still published) peer; one that failed otherwise
        strikes it, and may be on the wire too: released, the next one (``FENCE_RETRY_S``)
        covers it."""
        outcome: str | Exception
        if xfer.fence is None:
            if time.monotonic() < xfer.fence_due:
                return False
            local, remote = xfer.fence_pair
            xfer.fence, outcome = self._start(
                xfer.op, xfer.local_dlist, [local], xfer.peer.dlist, [remote]
            )
        else:
            try:
                outcome = str(self._peers.agent.check_xfer_state(xfer.fence))
            except Exception as exc:
                outcome = exc
        if outcome in ("PROC", "PEND"):
            return False
        if outcome == "DONE" or isinstance(outcome, Exception) and self._ends(xfer.peer, outcome):
            refused = self._refused.pop(xfer.peer, 0)
            if refused:
                logger.info(
                    "NixlTransport %s: a fence to %s went through after %d refused: its "
                    "failed transfers are reported", self._owner, xfer.peer.peer_id, refused,
                )  # fmt: skip
            if isinstance(outcome, Exception):  # a disconnect
                if self._peers.is_published(xfer.peer):  # a dead peer: faulted at once
                    self._health.raised(xfer.peer.peer_id, outcome)
                xfer.struck = True  # counted: its report strikes no more
            return True
        self._log_refused(tid, xfer, outcome)
        if self._peers.is_published(xfer.peer):  # one more failure of that peer's
            self._health.failed(xfer.peer.peer_id, f"a fence failed: {outcome}")
        if xfer.fence is not None:
            self._release_handle(tid, xfer.fence)
            xfer.fence = None
        first, most = FENCE_RETRY_S
        xfer.fence_wait = min(max(2 * xfer.fence_wait, first), most)
        xfer.fence_due = time.monotonic() + xfer.fence_wait
        return False

    def _log_refused(self, tid: int, xfer: _Transfer, outcome: str | Exception) -> None:
        """A fence refused without a disconnect: a warning at a peer's first refusal since one
        went through (a peer that never takes one is retried for as long as the transport
        lives), the others at debug level."""
        n = self._refused[xfer.peer] = self._refused.get(xfer.peer, 0) + 1
        if n > 1:
            logger.debug("NixlTransport %s: fence of transfer %d: %s", self._owner, tid, outcome)
            return
        logger.warning(
            "NixlTransport %s: NIXL refused a fence to %s (%s): the failed transfers to it stay "
            "in flight, reported only once a fence goes through (a failed %s may still land), "
            "fenced again up to every %.0f s until then or until the transport closes; further "
            "refusals are logged at debug level", self._owner, xfer.peer.peer_id, outcome,
            xfer.op, FENCE_RETRY_S[1],
        )  # fmt: skip

    def _checked_state(self, tid: int, xfer: _Transfer) -> str | None:
        """The transfer's NIXL state; ``None`` when the check raised but it may still write.

        A raising check faults the (still published) peer once per transfer and warns once;
        after a remote disconnect it returns ``_GONE``.
        """
        try:
            return str(self._peers.agent.check_xfer_state(xfer.handle))
        except Exception as exc:
            (logger.debug if xfer.struck else logger.warning)(
                "NixlTransport %s: check_xfer_state failed for transfer %d: %s",
                self._owner,
                tid,
                exc,
            )
            if not xfer.struck:
                xfer.struck = True
                if self._peers.is_published(xfer.peer):
                    self._health.state_check_raised(xfer.peer.peer_id, exc)
            return _GONE if self._ends(xfer.peer, exc) else None

    def _ends(self, peer: NixlPeer, exc: BaseException) -> bool:
        """``ends_transfer(exc)``; a remote disconnect also tells ``peers`` that the agent's
        endpoint failed (``NixlPeers.endpoint_failed``: it is never parked)."""
        if not ends_transfer(exc):
            return False
        self._peers.endpoint_failed(peer)
        return True

    def _forget(self, tid: int, *, release: bool) -> None:
        """Drop a transfer (releasing its handles if asked); free a retired peer it was last of."""
        xfer = self._transfers.pop(tid)
        if len(xfer.peer.inflight) <= 1:  # its last transfer: no fence of that peer is left
            self._refused.pop(xfer.peer, None)
        if release:
            for handle in (xfer.handle, xfer.fence):
                if handle is not None:
                    self._release_handle(tid, handle)
        self._peers.transfer_ended(xfer.peer, tid)

    def _release_handle(self, tid: int, handle: Any) -> None:
        try:
            self._peers.agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.debug("NixlTransport %s: releasing transfer %d: %s", self._owner, tid, exc)
