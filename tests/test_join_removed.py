"""A shared host removed (``disconnect``/``remove_peer``) while its join waits for the host's
index: the join waited out its whole ``timeout_s`` for a snapshot that could no longer come
(its session ended clean, so it saw no loss), and the user's next connect of the host waited
for that stale join and failed with its ``TimeoutError``. The join now ends as the host is
removed, before ``disconnect`` returns, and the next connect joins the host anew."""

from __future__ import annotations

import pytest
from join_support import withheld_join
from membership_support import WAIT_S


def test_a_host_removed_while_it_joins_ends_that_join_and_connects_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with withheld_join(monkeypatch, "removed-mid-join") as join:
        tier, peer_id = join.tier, join.peer_id
        joining = tier._joining[peer_id]
        assert peer_id in tier._peers  # published (placed), its index awaited:
        assert tier.peers() == []  # not joined yet (it was listed, and a user acted on it)
        tier.disconnect(peer_id)
        assert joining.is_set(), "disconnect returned while the host's join went on"
        assert isinstance(joining.failure, ConnectionError), joining.failure
        assert "removed" in str(joining.failure)
        assert join.joins[0].session.ended_clean  # its session ended: nothing held on the host
        assert tier.connect(join.server.address, timeout_s=WAIT_S) == peer_id
        assert tier.peers() == [peer_id] and len(join.joins) == 2
    [outcome] = join.outcome  # (its thread ended with the ``with``)
    assert isinstance(outcome, ConnectionError) and "removed" in str(outcome)
