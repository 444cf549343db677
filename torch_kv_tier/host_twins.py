"""Two processes answering as one host id: ``connect`` refuses a host whose id a connected host
has when another process answered it (``twin_address``: told apart by their NIXL agent
metadata), with a ``ValueError`` whose message ``twin_problem`` words: a host at the same
address restarted and the tier has not noticed yet (it will, and dials it again by itself), or
elsewhere two hosts may have been given one ``--host-id``.

Pure functions, no I/O: ``twin_address`` reads the manager's peers, so its caller holds the
manager's lock; neither raises.
"""

from __future__ import annotations

from typing import Any

from torch_kv_tier.records import Peer


def twin_address(peers: dict[str, Peer], peer_id: str, session: Any) -> str | None:
    """The address of the connected host ``peer_id`` when it is another process than the
    one ``session`` reached (two hosts with one id, or one that restarted unnoticed yet)."""
    peer = peers.get(peer_id)
    other = None if peer is None else peer.session
    if other is None or other.agent_metadata == session.agent_metadata:
        return None
    return str(other.address)


def twin_problem(address: str, peer_id: str, twin: str) -> str:
    """Why a connect of ``address`` reached another process than the host ``peer_id``
    connected at ``twin``: at the same address it restarted, which the tier has not noticed
    yet; elsewhere it may also be two hosts with one ``--host-id``."""
    noticed = (
        "this tier drops the old session within its heartbeat timeout (connect's "
        f"heartbeat_timeout_s) and dials {twin} again by itself"
    )
    if twin == address:
        return (
            f"the host {peer_id!r} at {address} restarted (another process answers there) and "
            f"this tier has not noticed yet: {noticed}; connect again after that"
        )
    return (
        f"the host at {address} calls itself {peer_id!r}, as does the host connected at "
        f"{twin}, another process: give each host its own --host-id (by default it is the "
        f"address the host listens on); or, if the host at {twin} restarted and answers here "
        f"now, {noticed}"
    )
