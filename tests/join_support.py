"""Shared-host joins whose index never comes: a join waits for it (its timeout, or until its
host is removed or the tier closed), published and placed but not joined; and joins held as
they register a host's region (``registrations_held``), connecting on threads of their own."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from membership_support import WAIT_S
from remote_support import BLOCK_LEN

from torch_kv_tier import shared_hosts
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

STUCK_S = 600.0  # a withheld join's timeout: longer than a test may take, were it waited out


def withhold_index(
    monkeypatch: pytest.MonkeyPatch, withheld: Callable[[int], bool]
) -> tuple[list[Any], threading.Event]:
    """Joins numbered (from 0, in order) so that ``withheld`` picks them get no index; the
    hosts joined, in order, and an event set once a withheld join waits for its index."""
    joins: list[Any] = []
    waiting = threading.Event()

    class Withholding(shared_hosts._HostChanges):
        def __init__(self, tier: Any, host: Any, synced: threading.Event) -> None:
            super().__init__(tier, host, synced)
            self.withheld = withheld(len(joins))
            joins.append(host)
            if self.withheld:
                waiting.set()

        def __call__(self, *args: Any) -> None:
            if not self.withheld:
                super().__call__(*args)

    monkeypatch.setattr(shared_hosts, "_HostChanges", Withholding)
    return joins, waiting


@dataclass
class WithheldJoin:
    """A host (``server``), a tier, and the tier's first connect of the host (on a thread of
    its own, ``STUCK_S``) waiting for the index withheld from it: ``peer_id`` is placed, not
    joined; ``joins`` are the hosts joined so far; ``outcome``, what that connect returned or
    raised once it ended (a ``disconnect`` of ``peer_id`` ends it)."""

    server: ServerProcess
    tier: TierManager
    peer_id: str
    joins: list[Any]
    outcome: list[object] = field(default_factory=list)


@contextmanager
def withheld_join(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[WithheldJoin]:
    """A ``WithheldJoin`` (the tier ``name``d), once its join waits for the index; on exit,
    its connect's thread is joined (``WAIT_S``): the test ended its join by then."""
    joins, following = withhold_index(monkeypatch, lambda n: n == 0)  # the first join's
    with (
        ServerProcess.start(32, BLOCK_LEN) as server,
        TierManager.create(16, BLOCK_LEN, name=name) as tier,
    ):
        outcome: list[object] = []

        def first_connect() -> None:
            try:
                outcome.append(tier.connect(server.address, timeout_s=STUCK_S))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=first_connect)
        thread.start()
        try:
            assert following.wait(WAIT_S), "the join never waited for the index"
            [peer_id] = tier._joining
            yield WithheldJoin(server, tier, peer_id, joins, outcome)
        finally:
            tier.close()  # (a test that failed early: its join ends)
            thread.join(WAIT_S)
            assert not thread.is_alive()


def registrations_held(
    monkeypatch: pytest.MonkeyPatch, tier: TierManager, held: Callable[[], bool]
) -> tuple[threading.Event, threading.Event]:
    """``(entered, go)``: ``tier``'s region registrations that ``held`` picks (asked on the
    registering thread) set ``entered``, then wait for ``go`` (bounded) before they begin."""
    entered, go = threading.Event(), threading.Event()
    register = tier._register

    def held_register(*args: Any) -> None:
        if held():
            entered.set()
            go.wait(timeout=WAIT_S)
        register(*args)

    monkeypatch.setattr(tier, "_register", held_register)
    return entered, go


def connect_on_a_thread(
    tier: TierManager, address: str, outcome: list[object], **kwargs: Any
) -> threading.Thread:
    """A thread (started) connecting ``address`` (``redial_if_down``, ``WAIT_S``); ``outcome``
    gets the peer id it returned, or what it raised."""

    def connect() -> None:
        try:
            outcome.append(tier.connect(address, timeout_s=WAIT_S, redial_if_down=True, **kwargs))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    return thread
