"""Which NIXL failures fault a peer, and the per-peer strike count that faults it otherwise.

The failure model (vLLM 0.33's, see ``base.py``): a transfer failure is transfer-scoped until
``MAX_CONSECUTIVE_FAILURES`` of them hit one peer with no success between; a state check that
raises, or an error naming a dead or unknown remote agent, faults the peer at once. Only a remote
disconnect proves that a transfer can no longer write (so does a fence that completed after
it: ``nixl_inflight``); every other raise leaves it in flight, because a WRITE was measured
upstream to keep landing after its handle raised "not found".
A disconnect would not prove it for a transfer NIXL's UCX backend split across its worker
threads (1,024 descriptors or more): one part's error completes the others while they may still
run (``nixlUcxChunkBackendReqH::status``). So the agents never let it split
(``ucx_env.ucx_backend_params``).

Threading: ``PeerHealth`` has no lock; its owner (``NixlTransport``) calls it under its own.
Pure Python: nothing here imports NIXL (errors are matched by class name and status text).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 3

# Binding exception class name -> NIXL status, for the errors that fault a peer at once.
_PEER_FAULT_ERRORS = {
    "nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT",
    "nixlNotFoundError": "NIXL_ERR_NOT_FOUND",
}


def peer_fault_status(exc: BaseException) -> str | None:
    """The NIXL status of ``exc`` when it faults its peer at once, else ``None``.

    Matched by class name first, then by the status text (bindings rename classes, and some
    paths wrap the status in a ``RuntimeError``).
    """
    status = _PEER_FAULT_ERRORS.get(type(exc).__name__)
    if status is not None:
        return status
    text = str(exc)
    return next((s for s in _PEER_FAULT_ERRORS.values() if s in text), None)


def ends_transfer(exc: BaseException) -> bool:
    """True when a raising state check proves the transfer can no longer write.

    Only a remote disconnect does: the target endpoint is gone, nothing more can land.
    """
    return peer_fault_status(exc) == "NIXL_ERR_REMOTE_DISCONNECT"


class PeerHealth:
    """Strikes and faults per peer id; a fault stays until ``forget(peer_id)``."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self.strikes: dict[str, int] = {}
        self.faults: dict[str, str] = {}

    def succeeded(self, peer_id: str) -> None:
        self.strikes.pop(peer_id, None)

    def failed(self, peer_id: str, cause: str) -> None:
        """One transfer-scoped failure; the ``MAX_CONSECUTIVE_FAILURES``-th faults the peer."""
        n = self.strikes.get(peer_id, 0) + 1
        self.strikes[peer_id] = n
        if n >= MAX_CONSECUTIVE_FAILURES:
            self.fault(peer_id, f"{n} consecutive transfer failures (last: {cause})")

    def raised(self, peer_id: str, exc: BaseException) -> None:
        """A NIXL call for ``peer_id`` raised: a peer fault if it names one, else a strike."""
        status = peer_fault_status(exc)
        if status is not None:
            self.fault(peer_id, status)
        else:
            self.failed(peer_id, f"{type(exc).__name__}: {exc}")

    def state_check_raised(self, peer_id: str, exc: BaseException) -> None:
        """``check_xfer_state`` raised: fault the peer at once.

        The bindings raise for every NIXL error status, so this is a failure NIXL reported. With
        strikes instead, successes of other transfers could reset them forever while this one
        stays in flight.
        """
        self.fault(
            peer_id,
            peer_fault_status(exc) or f"check_xfer_state raised {type(exc).__name__}: {exc}",
        )

    def fault(self, peer_id: str, cause: str) -> None:
        if peer_id in self.faults:
            return
        self.faults[peer_id] = cause
        logger.warning("%s: peer %s judged unusable: %s", self._owner, peer_id, cause)

    def forget(self, peer_id: str) -> None:
        self.strikes.pop(peer_id, None)
        self.faults.pop(peer_id, None)
