"""Shared-host joins whose index never comes: a join waits for it (its timeout, or until its
host is removed or the tier closed), published and placed but not joined."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from torch_kv_tier import shared_hosts


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
