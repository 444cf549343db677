"""A shared host removed (``disconnect``/``remove_peer``) while its join waits for the host's
index: the join waited out its whole ``timeout_s`` for a snapshot that could no longer come
(its session ended clean, so it saw no loss), and the user's next connect of the host waited
for that stale join and failed with its ``TimeoutError``. The join now ends as the host is
removed, before ``disconnect`` returns, and the next connect joins the host anew."""

from __future__ import annotations

import threading

import pytest
from join_support import withhold_index
from membership_support import WAIT_S
from remote_support import BLOCK_LEN

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

_STUCK_S = 600.0  # the first join's timeout: longer than the test may take, were it waited out


def test_a_host_removed_while_it_joins_ends_that_join_and_connects_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    joins, following = withhold_index(monkeypatch, lambda n: n == 0)  # the first join's
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="removed-mid-join") as tier,
    ):
        outcome: list[BaseException] = []

        def first_connect() -> None:
            try:
                tier.connect(server.address, timeout_s=_STUCK_S)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=first_connect)
        thread.start()
        assert following.wait(WAIT_S)
        [peer_id] = tier._joining
        joining = tier._joining[peer_id]
        assert peer_id in tier._peers  # published (placed), its index awaited:
        assert tier.peers() == []  # not joined yet (it was listed, and a user acted on it)
        tier.disconnect(peer_id)
        assert joining.is_set(), "disconnect returned while the host's join went on"
        assert isinstance(joining.failure, ConnectionError), joining.failure
        assert "removed" in str(joining.failure)
        assert joins[0].session.ended_clean  # its session ended: nothing held on the host
        assert tier.connect(server.address, timeout_s=WAIT_S) == peer_id
        assert tier.peers() == [peer_id] and len(joins) == 2
        thread.join(WAIT_S)
        assert not thread.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], ConnectionError) and "removed" in str(outcome[0])
