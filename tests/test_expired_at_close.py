"""A tier's session its host ended by itself (its lease expired as the tier's process stalled)
just before ``close``: the host holds that session's lease until it is named resolved, so
``close``'s last word names it, as it names a dropped session's; its disconnect, which hears
that the host no longer knows it, says so at info."""

from __future__ import annotations

import threading

from release_support import RESULT_TIMEOUT_S, assert_nothing_held
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess


def test_a_session_expired_by_its_lease_before_close_is_released_by_closes_last_word() -> None:
    """Found by review: a clean ``close`` whose session the host had expired (the tier's I/O
    thread stalled past the lease timeout, then the disconnect was the first thing it sent)
    left the host holding that session's private lease for good (``--hold-timeout``: never),
    and the client said only, at info, that the host had ended it already."""
    extra = ["--lease-timeout", "1"]
    with (
        ServerProcess.start(64, BLOCK_LEN, extra_args=extra) as server,
        TierManager.create(16, BLOCK_LEN, name="expired") as tier,
    ):
        peer = tier.connect(server.address, private=True, slots=8)
        session = tier._peers[peer].session
        assert session is not None

        def stall() -> None:  # the I/O thread stalls (a loaded machine) until close began
            assert wait_for(lambda: session._closed, RESULT_TIMEOUT_S)

        session._actions.put(stall)
        session._wake()
        with fake_session(server.address, private=False) as observer:
            expired = wait_for(
                lambda: (
                    session.public_id not in {s["public_id"] for s in observer.stats()["sessions"]}
                ),
                RESULT_TIMEOUT_S,
            )
            assert expired, "the host did not expire the stalled session"
            assert observer.stats()["held_sessions"] == 1
        closer = threading.Thread(target=tier.close, args=(RESULT_TIMEOUT_S,))
        closer.start()
        closer.join(timeout=2 * RESULT_TIMEOUT_S)
        assert not closer.is_alive()
        assert not session.ended_clean
        assert_nothing_held(server.address)
