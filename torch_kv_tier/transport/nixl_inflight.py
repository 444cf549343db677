"""``NixlInflight``: the transfers a ``NixlTransport`` posted and has not reported yet, from the
post to the release of their handles.

Failure model (vLLM 0.33's, see ``base.py`` and ``faults.py``). A transfer whose state check
raises faults its (still published) peer once and stays in flight: a WRITE may keep landing after
its handle raised, so only a remote disconnect (the target endpoint is gone) ends it. A handle is
released only once its transfer is over, or when the owner asks (``cancel(mode="immediate")``,
``release_all``). A post that fails after NIXL created the request with a remote disconnect marks
the agent unsafe to destroy (``agent_lifetime``).

Threading: no lock of its own. Every method expects the caller to hold the transport's lock,
which also guards ``NixlPeers`` and ``PeerHealth`` (the tables this one updates).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch_kv_tier.transport import agent_lifetime
from torch_kv_tier.transport.base import CancelMode, PollResult
from torch_kv_tier.transport.faults import PeerHealth, ends_transfer
from torch_kv_tier.transport.nixl_peers import NixlPeer, NixlPeers

# The transport's logger: these lines are the transport's (``NixlTransport <name>: ...``).
logger = logging.getLogger("torch_kv_tier.transport.nixl")

_GONE = "GONE"  # pseudo-state: the check raised a remote disconnect, the transfer is over
_RUNNING = ("PROC", "PEND", None)  # may still write (``None``: the check raised, see above)


@dataclass(eq=False)
class _Transfer:
    peer: NixlPeer
    handle: Any
    struck: bool = False  # already counted against its peer (a raising check counts once)


class NixlInflight:
    """In-flight transfers by id (module docstring); the agent is ``peers.agent``."""

    def __init__(self, owner: str, peers: NixlPeers, health: PeerHealth) -> None:
        self._owner = owner  # the transport's name, for logs
        self._peers = peers
        self._health = health
        self._transfers: dict[int, _Transfer] = {}
        self._ids = itertools.count(1)
        self._kept_until_exit = False  # see agent_lifetime

    def __len__(self) -> int:
        return len(self._transfers)

    def __iter__(self) -> Iterator[int]:
        """The ids in flight (a snapshot is the caller's to take)."""
        return iter(self._transfers)

    def post(
        self, op: str, local_dlist: Any, local: Sequence[int], peer: NixlPeer, remote: Sequence[int]
    ) -> int | None:
        """Post ``op`` ("WRITE" or "READ") between prepared block indices; its id, or ``None``
        when NIXL refused or raised (logged, and counted against the peer)."""
        agent = self._peers.agent
        handle = None
        try:
            handle = agent.make_prepped_xfer(op, local_dlist, local, peer.dlist, remote)
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL refused to post the transfer (state ERR)")
        except Exception as exc:
            logger.warning(
                "NixlTransport %s: %s to %s failed: %s", self._owner, op, peer.peer_id, exc
            )
            if handle is not None:
                if agent_lifetime.is_post_disconnect(exc) and not self._kept_until_exit:
                    # UCX may still hold a request NIXL freed: never destroy this agent.
                    self._kept_until_exit = True
                    agent_lifetime.keep_until_exit(agent, self._owner)
                self._release_handle(-1, handle)
            self._health.raised(peer.peer_id, exc)
            return None
        tid = next(self._ids)
        self._transfers[tid] = _Transfer(peer, handle)
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
            state = self._checked_state(tid, xfer)
            if state == "DONE":
                done.append(tid)
                succeeded.add(xfer.peer)
            elif state not in _RUNNING:
                failed.append(tid)
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
        it. A release that raises keeps it too.
        """
        still: list[int] = []
        for tid in transfer_ids:
            xfer = self._transfers.get(tid)
            if xfer is None:
                continue
            if mode == "immediate":
                self._forget(tid, release=True)
                continue
            state = self._checked_state(tid, xfer)
            if state == _GONE:  # the handle may not release any more; nothing more lands
                self._forget(tid, release=True)
                continue
            if state in _RUNNING:
                still.append(tid)
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
        for tid in list(self._transfers):
            self._forget(tid, release=True)

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
            return _GONE if ends_transfer(exc) else None

    def _forget(self, tid: int, *, release: bool) -> None:
        """Drop a transfer (releasing its handle if asked); free a retired peer it was last of."""
        xfer = self._transfers.pop(tid)
        if release:
            self._release_handle(tid, xfer.handle)
        self._peers.transfer_ended(xfer.peer, tid)

    def _release_handle(self, tid: int, handle: Any) -> None:
        try:
            self._peers.agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.debug("NixlTransport %s: releasing transfer %d: %s", self._owner, tid, exc)
