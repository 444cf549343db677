"""The model of ``test_disk_fuzz`` (the disk tier's crash fuzzer): what a start may serve
(``Model``, its ``View`` as a kill leaves it, ``check_found``) and the failures it injects
(``inject_fault``: an ``os`` file call, a block read or overwrite, a block write refused)."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from disk_support import under

from torch_kv_tier.remote.disk_store import DiskStore

FILE_CALLS = ("write", "fsync", "fdatasync", "ftruncate", "replace", "unlink")
# a start's too: its blocks read, and overwritten where a key is in two directories (``_spoil``)
START_CALLS = (*FILE_CALLS, "preadv", "pwritev")


@dataclass
class Model:
    """What a start may serve: each key's digest as of the last acknowledged sync (None:
    removed), the digests stored since (in flight at a kill), and those ``maybe`` still
    named by a journal that a faulted start may not have rewritten (each key's, until a store
    or removal of it is acknowledged: its newest bytes, whether that start served them or not).
    """

    now: dict[bytes, int | None] = field(default_factory=dict)
    acked: dict[bytes, int | None] = field(default_factory=dict)
    since: dict[bytes, frozenset[int]] = field(default_factory=dict)
    touched: frozenset[bytes] = frozenset()
    maybe: dict[bytes, frozenset[int]] = field(default_factory=dict)

    def stored(self, key: bytes, digest: int) -> None:
        self.now[key] = digest
        self.since = {**self.since, key: self.since.get(key, frozenset()) | {digest}}
        self.touched |= {key}

    def removed(self, key: bytes) -> None:
        self.now[key] = None
        self.touched |= {key}

    def synced(self) -> None:
        self.maybe = {key: got for key, got in self.maybe.items() if key not in self.touched}
        self.since, self.touched = {}, frozenset()
        self.acked = dict(self.now)

    def view(self) -> View:
        """A copy, as a kill leaves it (taken on any thread: each field is replaced whole)."""
        return dict(self.acked), dict(self.since), self.touched, self.maybe


# what a start may serve (``Model.view``): acked, since, touched, maybe
View = tuple[
    dict[bytes, int | None],
    dict[bytes, frozenset[int]],
    frozenset[bytes],
    dict[bytes, frozenset[int]],
]


def allowed_digests(view: View, key: bytes) -> frozenset[int | None]:
    """The digests a start may serve ``key`` with as ``view`` says (None: a miss)."""
    acked, since, _, maybe = view
    return frozenset({acked.get(key)}) | since.get(key, frozenset()) | maybe.get(key, frozenset())


@contextmanager
def inject_fault(rng: random.Random, root: Path, store: DiskStore | None) -> Iterator[str]:
    """One failure injected for an operation: the n-th file call of one kind under ``root``
    (a write, sync, truncation, rename or removal) raises EIO or ENOSPC, or a block write of
    ``store`` is refused as it starts; without a store (a start), a block's read or overwrite
    may fail instead."""
    kind = rng.choice([*FILE_CALLS, "transfer"] if store else START_CALLS)
    nth, code = rng.randint(1, 3), rng.choice([errno.EIO, errno.ENOSPC])
    calls = [0]
    ours = under(root)

    def hit(target: Any) -> bool:
        if not ours(target):
            return False
        calls[0] += 1
        return calls[0] == nth

    with pytest.MonkeyPatch.context() as m:
        if kind == "transfer" and store is not None:

            def refused(handle: Any) -> str:
                raise RuntimeError("injected: the write could not start")

            m.setattr(store._io._agent, "transfer", refused)
        else:
            real = getattr(os, kind)

            def failing(target: Any, *args: Any) -> Any:
                if hit(target):
                    raise OSError(code, os.strerror(code))
                return real(target, *args)

            m.setattr(os, kind, failing)
        yield f"{kind}#{nth}:{errno.errorcode[code]}"


@contextmanager
def inject_faults(
    rng: random.Random, root: Path, store: DiskStore | None, count: int
) -> Iterator[str]:
    """``count`` failures injected at once (``inject_fault``); what they are, for a failure's
    message."""
    with ExitStack() as stack:
        yield " ".join(stack.enter_context(inject_fault(rng, root, store)) for _ in range(count))


def check_found(found: dict[bytes, int], view: View, clean: bool, what: str) -> None:
    acked, _, touched, _ = view
    for key, digest in found.items():
        allowed = allowed_digests(view, key)
        assert digest in allowed, (
            f"{what}: {key!r} served with bytes of neither its last acknowledged store nor "
            f"one since ({digest:x} not in {allowed})"
        )
    if clean:  # nothing injected: every key acknowledged and untouched since is found
        for key, digest in acked.items():
            if digest is not None and key not in touched:
                assert found.get(key) == digest, f"{what}: {key!r} lost"
