"""A connect that gave up waiting for its ``Accept`` (``AcceptLost``) may have opened a private
lease the tier never learned of: the tier knows the session's id, and the host holds the lease
(unreleased, it expires into held slots) until that id is named in a release. Nobody
connecting to that host again, the failed connect names it at once over a session of its own:
before, the host held the lease for good (without ``--hold-timeout``) though nothing of it was
ever written, and ``close`` only warned that the host was no longer dialled."""

from __future__ import annotations

from typing import Any

import pytest
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess, handshake
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.handshake_errors import AcceptLost

POOL = 64


@pytest.mark.timeout(60)
def test_a_lease_opened_by_a_connect_that_gave_up_is_released_when_the_tier_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = handshake._expect

    def accept_after_the_deadline(
        sock: Any, address: str, seq: int, deadline: float, kind: type, *args: Any
    ) -> Any:
        reply = real(sock, address, seq, deadline, kind, *args)
        if kind is p.Accept:  # it came (the host opened the lease), as if too late
            raise TimeoutError(f"no Accept from {address} by the deadline")
        return reply

    monkeypatch.setattr(handshake, "_expect", accept_after_the_deadline)
    extra = ["--lease-timeout", "1"]
    with ServerProcess.start(POOL, BLOCK_LEN, extra_args=extra) as server:
        with (
            TierManager.create(16, BLOCK_LEN, name="gave-up") as tier,
            pytest.raises(AcceptLost),
        ):
            tier.connect(server.address, private=True, slots=POOL - 16)
        monkeypatch.undo()  # the observer's own handshake is a plain one
        with fake_session(server.address, private=False) as observer:
            freed = wait_for(lambda: observer.stats()["free_blocks"] == POOL, 10.0)
            stats = observer.stats()
            assert freed, {k: stats[k] for k in ("free_blocks", "leased_blocks", "held_blocks")}
