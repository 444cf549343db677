"""``add_peer`` of a host's id while a join of that host is under way: it stops that join
(never published), which then let go of the host's region in the transport, ``add_peer``'s
included (registering: ``add_peer`` raised "superseded"; registered: the peer it published had
no region, its first store failed). ``add_peer`` now registers once that join ended
(``TimeoutError`` saying to add the peer again when it still runs after 10 s)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from join_support import connect_on_a_thread, registrations_held
from membership_support import WAIT_S
from remote_support import BLOCK_LEN

from torch_kv_tier import private_regions
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess


def test_add_peer_of_a_host_whose_join_registers_keeps_its_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``add_peer`` of a joining host's id stops that join, which then let go of the host's
    region in the transport: ``add_peer``'s, registering (it raised "superseded") or
    registered meanwhile (the peer it published had none: ``peers()`` listed it, its first
    store failed and dropped it)."""
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="added-over-a-join") as tier,
    ):
        entered, go, ended = threading.Event(), threading.Event(), threading.Event()
        region: list[Any] = []
        register = tier._register

        def register_in_turn(*args: Any) -> None:
            register(*args)
            if not region:  # the join's: it publishes (or not) once let go
                region.extend(args[1:])
                entered.set()
                go.wait(timeout=WAIT_S)
            else:  # add_peer's: it publishes once the join ended
                ended.wait(timeout=WAIT_S)

        monkeypatch.setattr(tier, "_register", register_in_turn)
        outcome: list[object] = []
        connecting = connect_on_a_thread(tier, server.address, outcome, private=True, slots=8)
        assert entered.wait(WAIT_S), "the join never registered the host"
        [peer_id] = tier._joining
        joining = tier._joining[peer_id]
        adding = threading.Thread(target=tier.add_peer, args=(peer_id, *region[:2], 8, region[3]))
        adding.start()
        assert joining.stopped.wait(WAIT_S), "add_peer did not stop the host's join"
        go.set()
        assert joining.wait(WAIT_S), "the join never ended"
        ended.set()
        adding.join(WAIT_S)
        connecting.join(WAIT_S)
        assert not adding.is_alive() and not connecting.is_alive()
        [failed] = outcome
        assert isinstance(failed, ConnectionError) and "removed" in str(failed), failed
        assert tier.peers() == [peer_id] and tier._peers[peer_id].session is None
        registered = tier.transport._peers.get(peer_id)  # type: ignore[attr-defined]
        assert registered is not None, "add_peer's region was let go"
        tier.arena.tensor[:1].random_(0, 256)
        assert tier.store(["k"], [0]).result(timeout=WAIT_S).ok
        assert tier.load(["k"], [1]).result(timeout=WAIT_S).ok
        assert torch.equal(tier.arena.tensor[1], tier.arena.tensor[0])


def test_add_peer_of_a_host_whose_join_runs_on_says_to_add_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The join ``add_peer`` stopped still runs once its wait for it ran out (10 s; NIXL may
    register longer): ``add_peer`` raises ``TimeoutError`` saying to add the peer again, and
    registers nothing that join could let go of; once it ended, ``add_peer`` works."""
    monkeypatch.setattr(private_regions, "CONNECT_TIMEOUT_S", 0.1)  # add_peer's wait
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name="added-over-a-long-join") as tier,
    ):
        region: list[Any] = []
        entered, go = registrations_held(monkeypatch, tier, lambda: not go.is_set())
        register = tier._register

        def noted_register(*args: Any) -> None:
            region[:] = args[1:]
            register(*args)

        monkeypatch.setattr(tier, "_register", noted_register)
        outcome: list[object] = []
        connecting = connect_on_a_thread(tier, server.address, outcome, private=True, slots=8)
        assert entered.wait(WAIT_S), "the join never registered the host"
        [peer_id] = tier._joining
        with pytest.raises(TimeoutError, match="add_peer again"):
            tier.add_peer(peer_id, *region[:2], 8, region[3])
        go.set()
        connecting.join(WAIT_S)
        assert not connecting.is_alive()
        [failed] = outcome
        assert isinstance(failed, ConnectionError) and "removed" in str(failed), failed
        tier.add_peer(peer_id, *region[:2], 8, region[3])
        assert tier.peers() == [peer_id]
        tier.arena.tensor[:1].random_(0, 256)
        assert tier.store(["k"], [0]).result(timeout=WAIT_S).ok
