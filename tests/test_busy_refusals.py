"""``connect(..., redial_if_down=True)`` of a host that refuses for now (``no free slots``,
``too many sessions``, ``... try again later``: ``HandshakeRejected.busy``) dials it again in
the background until it has room, as it does a host not up yet; a refusal no wait mends (a bad
token, another block length) stays final."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from remote_support import BLOCK_LEN, fake_session, wait_for

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import HandshakeRejected, ServerProcess
from torch_kv_tier.remote import protocol as p

RESULT_TIMEOUT_S = 20.0
POOL = 32


@pytest.mark.parametrize(
    ("extra", "held_slots", "reason"),
    [
        (["--max-sessions", "1"], 8, p.TOO_MANY_SESSIONS),
        ([], POOL, p.NO_FREE_SLOTS),
    ],
    ids=["too-many-sessions", "no-free-slots"],
)
def test_a_connect_refused_for_now_joins_once_the_host_has_room(
    extra: list[str], held_slots: int, reason: str
) -> None:
    """Found by review: a host at its ``--max-sessions``, or with every slot leased, refused
    ``connect(..., redial_if_down=True)`` for good (``HandshakeRejected``, never dialled again),
    though waiting mends it: only a host that did not answer at all was dialled again. The
    refusal is raised (with the note that says so) and the host joins once it has room."""
    with (
        ServerProcess.start(POOL, BLOCK_LEN, extra_args=extra) as server,
        TierManager.create(4, BLOCK_LEN, name="busy") as tier,
    ):
        holder = fake_session(server.address, slots=held_slots)
        try:
            with pytest.raises(HandshakeRejected) as refused:
                tier.connect(server.address, private=True, slots=4, redial_if_down=True)
            assert refused.value.reason.startswith(reason), refused.value.reason
            assert refused.value.busy
            assert any("dialled again" in note for note in refused.value.__notes__)
        finally:
            holder.close()
        assert wait_for(lambda: len(tier.peers()) == 1, RESULT_TIMEOUT_S), "never joined"


def test_a_refusal_no_wait_mends_stays_final(tmp_path: Path) -> None:
    """A bad token is refused at once, and the host is not dialled again."""
    token = tmp_path / "token"
    token.write_text("the host's token")
    os.chmod(token, 0o600)
    with (
        ServerProcess.start(POOL, BLOCK_LEN, token_file=str(token)) as server,
        TierManager.create(4, BLOCK_LEN, name="refused") as tier,
    ):
        with pytest.raises(HandshakeRejected) as refused:
            tier.connect(server.address, private=True, token="another", redial_if_down=True)
        assert refused.value.reason == "bad token" and not refused.value.busy
        assert not getattr(refused.value, "__notes__", None)
        assert not tier.cancel_dial(server.address), "a refused host was dialled again"


@pytest.mark.parametrize(
    ("reason", "busy"),
    [
        (f"{p.NO_FREE_SLOTS} (8 held for clients that may still write)", True),
        (f"{p.TOO_MANY_SESSIONS} (--max-sessions 1)", True),
        (f"more than 65536 handshakes in the last 30 s: {p.TRY_AGAIN_LATER}", True),
        ("bad token", False),
        ("config fingerprint mismatch", False),
        ("block_len 65536 != 32768", False),
        (f"protocol version 5 != {p.PROTOCOL_VERSION}", False),
        (p.STALE_NONCE, False),
    ],
)
def test_busy_tells_the_host_s_state_from_a_refusal_of_the_client(reason: str, busy: bool) -> None:
    assert HandshakeRejected("h:1", reason).busy is busy
