"""What the membership and dial tests share: a hosts file replaced atomically, a fake tier and a
``Membership`` following a source on it, the names of a tier's session and redial threads, a
tier connected to a host of its own, connects that find their host down, and redials quick
enough for a test, with how long to wait for their join."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from remote_support import BLOCK_LEN

from torch_kv_tier import connections
from torch_kv_tier.manager import TierManager
from torch_kv_tier.membership import (
    Membership,
)
from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.results import TIER_CLOSED

WAIT_S = 10.0


# -- watched file ------------------------------------------------------------------------------


def write_hosts(path: Path, text: str) -> None:
    """Replace ``path`` atomically, as the README says to."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- Membership against a fake tier ------------------------------------------------------------


class FakeTier:
    """Records connect/disconnect; a host's peer id is ``host:`` + its name (both of a host's
    addresses reach the same peer); ``down`` addresses time out."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.kwargs: list[dict[str, Any]] = []
        self.down: set[str] = set()
        self.closed = False
        self.callers: set[str] = set()

    def connect(self, address: str, **kwargs: Any) -> str:
        with self.lock:
            self.callers.add(threading.current_thread().name)
            if self.closed:
                raise RuntimeError(TIER_CLOSED)
            self.calls.append(("connect", address))
            self.kwargs.append(kwargs)
            if address in self.down:
                raise TimeoutError(f"no answer from {address}")
            peer = "host:" + address.split("/")[0]
            self.live.add(peer)
            return peer

    def disconnect(self, peer_id: str) -> None:
        with self.lock:
            self.calls.append(("disconnect", peer_id))
            if peer_id not in self.live:
                raise KeyError(peer_id)
            self.live.discard(peer_id)

    def peers(self) -> list[str]:
        with self.lock:
            return sorted(self.live)

    placing_peers = peers  # (what ``Membership`` looks at: no host joins here for long)

    def count(self, call: tuple[str, str]) -> int:
        with self.lock:
            return self.calls.count(call)


@contextmanager
def following(
    tier: Any, source: Any, *, interval_s: float = 0.1, stop_s: float = 5.0, **kwargs: Any
) -> Iterator[Membership]:
    """A started ``Membership`` of ``tier`` over ``source`` (``kwargs`` go to it), stopped with
    ``stop_s`` on exit, a failing test's too."""
    membership = Membership(tier, source, interval_s=interval_s, **kwargs)
    membership.start()
    try:
        yield membership
    finally:
        membership.stop(timeout=stop_s)


def session_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tkvt-session"))


@contextmanager
def connected_tier(name: str) -> Iterator[tuple[TierManager, str, tuple[Any, ...]]]:
    """A tier connected to a host of its own: the tier, the host's peer id, and ``add_peer``'s
    arguments for 8 of the host's slots (a region the user registers under that id)."""
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name=name) as tier,
    ):
        peer = tier.connect(server.address, timeout_s=5.0)
        session = tier._peers[peer].session
        assert session is not None
        yield tier, peer, (session.agent_metadata, session.base_addr, 8, session.block_len)


# -- hosts down at their connect (redial_if_down) ---------------------------------------------


def redial_quickly(monkeypatch: pytest.MonkeyPatch, max_s: float = 1.0) -> None:
    """Have tiers dial a lost host (or one down at its connect) again 0.1 s after, the backoff
    doubling up to ``max_s`` (not ``REDIAL_MAX_S``'s 10 s): a host that comes up is tried
    again within ``max_s`` (``join_wait_s``)."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    monkeypatch.setattr(connections, "REDIAL_MAX_S", max_s)


def join_wait_s() -> float:
    """How long to wait for a host that came up to join through the redialer: its backoff grew
    while it was down (or starting), so its next try may come up to ``REDIAL_MAX_S`` (as
    patched) after it is up, then the join has ``WAIT_S``."""
    return connections.REDIAL_MAX_S + WAIT_S


def redial_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == connections.REDIAL_THREAD]


def down_for_the_caller(monkeypatch: pytest.MonkeyPatch, tier: TierManager) -> None:
    """``tier``'s connects on the main thread find their host down (``TimeoutError``); the
    redialer's threads reach it."""
    real_connect = tier._connect

    def down_on_the_callers_thread(dial: Any) -> str:
        if threading.current_thread() is threading.main_thread():
            raise TimeoutError(f"nothing answered at {dial.address}")
        return real_connect(dial)

    monkeypatch.setattr(tier, "_connect", down_on_the_callers_thread)
