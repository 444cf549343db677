"""Shared fixtures: remote peers in other processes, and a tier's block geometry."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from remote_peer import RemotePeer  # noqa: E402

BLOCK_LEN = 4096


def pytest_configure(config: pytest.Config) -> None:
    """No automatic cyclic garbage collection in the test process.

    The test process intermittently aborted (SIGABRT, "Garbage-collecting" on the main thread,
    about 1 run in 5 of the whole suite) while the cyclic collector finalised garbage left by
    earlier tests; the object at fault was not found. Reference counting still frees all
    acyclic garbage; cycles wait, and are frozen (never collected) when the session ends.
    Tests that spawn processes are unaffected. An open bug, see the issue note.
    """
    gc.disable()


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.freeze()


@pytest.fixture
def peer() -> Iterator[RemotePeer]:
    """One remote peer process with 1,024 blocks of 4 KiB."""
    with RemotePeer(1024, BLOCK_LEN) as p:
        yield p


@pytest.fixture
def peer2() -> Iterator[RemotePeer]:
    """A second, independent remote peer process."""
    with RemotePeer(1024, BLOCK_LEN) as p:
        yield p
