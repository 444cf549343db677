"""A refused ``connect`` says what to do, not only what the host said: a new user who passed no
token, another block length or another model got the host's bare reason (``bad token``,
``block_len 32768 != 65536``) with no word of which side is which or what to change. The
``reason`` stays the host's exact words."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from remote_support import BLOCK_LEN

from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import HandshakeRejected, ServerProcess
from torch_kv_tier.remote import protocol as p

POOL = 16
FIELDS = {"model": "llama-3-8b"}


def _refusal(address: str, block_len: int = BLOCK_LEN, **connect: object) -> HandshakeRejected:
    with (
        TierManager.create(4, block_len, name="refused", config_fields={"model": "other"}) as t,
        pytest.raises(HandshakeRejected) as refused,
    ):
        t.connect(address, **connect)  # type: ignore[arg-type]
    return refused.value


def test_a_refused_connect_says_what_to_change(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("the host's token")
    os.chmod(token, 0o600)
    with ServerProcess.start(
        POOL, BLOCK_LEN, token_file=str(token), config_fields=FIELDS
    ) as server:
        no_token = _refusal(server.address)
        assert no_token.reason == "bad token"
        assert "token=" in str(no_token) and "--token-file" in str(no_token)

        other_len = _refusal(server.address, BLOCK_LEN // 2, token="the host's token")
        assert other_len.reason == f"block_len {BLOCK_LEN // 2} != {BLOCK_LEN}"
        assert "--block-len" in str(other_len) and "tier's block_len comes first" in str(other_len)

        other_model = _refusal(server.address, token="the host's token")
        assert other_model.reason == "config fingerprint mismatch"
        assert "config_fields" in str(other_model)


def test_a_token_passed_to_a_host_without_one_says_so() -> None:
    with ServerProcess.start(POOL, BLOCK_LEN) as server:
        refused = _refusal(server.address, token="a token")
    assert "without --token-file" in str(refused) and "pass no token" in str(refused)


def test_a_version_skew_says_to_run_one_release() -> None:
    refused = HandshakeRejected("h:1", f"protocol version 99 != {p.PROTOCOL_VERSION}")
    assert "same torch_kv_tier release" in str(refused)
    busy = HandshakeRejected("h:1", p.NO_FREE_SLOTS)
    assert str(busy).endswith(p.NO_FREE_SLOTS), "a busy refusal has its own note"
