"""Helpers of the release tests (``test_session_releases``, ``test_close_releases``,
``test_moved_host_releases``): a host holding an ended session, and whether it still holds one."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import RemoteSession, ServerProcess
from torch_kv_tier.remote import protocol as p

RESULT_TIMEOUT_S = 20.0


def held_session(address: str) -> RemoteSession:
    """A shared session at ``address`` granted 2 slots and ended unclean, as if a write of it
    could still land: the host holds it until it is named resolved."""
    session = fake_session(address, private=False)
    granted: Future[Future[p.ServerMessage]] = Future()
    session.grant(2, granted.set_result)
    assert isinstance(granted.result(timeout=10).result(), p.Granted)
    session.close(clean=False)
    return session


@contextmanager
def connected_beside_a_held_session(
    name: str,
) -> Iterator[tuple[ServerProcess, TierManager, RemoteSession, str, RemoteSession]]:
    """A host holding one ended session (``held_session``) and a tier connected to it: the
    host, the tier, the held session, the host's peer id and the tier's session."""
    with (
        ServerProcess.start(64, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name=name) as tier,
    ):
        held = held_session(server.address)
        peer = tier.connect(server.address)
        session = tier._peers[peer].session
        assert session is not None
        yield server, tier, held, peer, session


def assert_nothing_held(address: str) -> None:
    """The host at ``address`` holds no ended session's slots (within 10 s)."""
    with fake_session(address, private=False) as observer:
        held = wait_for(lambda: observer.stats()["held_sessions"] == 0, 10.0)
        assert held, observer.stats()["held_sessions"]
