"""A model-based crash fuzzer of the disk tier's restart path: per seed, a random history of a
few keys over one or two directories (stores, removals, stores again with other bytes, journal
syncs, forced compactions), with write, sync, rename and removal failures injected (EIO, ENOSPC,
a block write refused), the host killed at a random file step (``copy_at_each_step``: the
directories as that step leaves them), started on that copy, for one to three such lives. Then
some copies of the last life are started (each start killed at a random step, at every step for
one copy, and that copy started), each started twice. Each start may serve a key only with the
bytes of its last store acknowledged (a ``sync`` that returned True after it) before the kill,
or of a store since; a key whose removal was acknowledged never comes back; a second start
serves what the first did; a history with nothing injected loses no key acknowledged and
untouched since.

``TKVT_DISK_FUZZ_SEEDS`` runs more seeds (default 6), from ``TKVT_DISK_FUZZ_FIRST`` (default 0),
e.g. ``TKVT_DISK_FUZZ_SEEDS=500 pytest tests/test_disk_fuzz.py``."""

from __future__ import annotations

import errno
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disk_support import DISK_POOL, copy_at_each_step, digest_of, open_store, settle, under

from torch_kv_tier.remote.disk_store import DiskStore

SEEDS = int(os.environ.get("TKVT_DISK_FUZZ_SEEDS", "6"))
FIRST = int(os.environ.get("TKVT_DISK_FUZZ_FIRST", "0"))
KEYS = [b"A", b"B", b"C", b"D"]
SLOTS = 8  # per directory: the keys never evict one another
FILE_CALLS = ("write", "fsync", "fdatasync", "ftruncate", "replace", "unlink")


@dataclass
class _Model:
    """What a start may serve: each key's digest as of the last acknowledged sync (None:
    removed), and the digests stored since (in flight at a kill)."""

    now: dict[bytes, int | None] = field(default_factory=dict)
    acked: dict[bytes, int | None] = field(default_factory=dict)
    since: dict[bytes, frozenset[int]] = field(default_factory=dict)
    touched: frozenset[bytes] = frozenset()

    def stored(self, key: bytes, digest: int) -> None:
        self.now[key] = digest
        self.since = {**self.since, key: self.since.get(key, frozenset()) | {digest}}
        self.touched |= {key}

    def removed(self, key: bytes) -> None:
        self.now[key] = None
        self.touched |= {key}

    def synced(self) -> None:
        self.since, self.touched = {}, frozenset()
        self.acked = dict(self.now)

    def view(self) -> tuple[dict[bytes, int | None], dict[bytes, frozenset[int]], frozenset[bytes]]:
        """A copy, as a kill leaves it (taken on any thread: each field is replaced whole)."""
        return dict(self.acked), dict(self.since), self.touched


@contextmanager
def _fault(rng: random.Random, root: Path, store: DiskStore) -> Iterator[str]:
    """One failure injected for an operation: the n-th file call of one kind under ``root``
    (a write, sync, truncation, rename or removal) raises EIO or ENOSPC, or a block write is
    refused as it starts."""
    kind = rng.choice([*FILE_CALLS, "transfer"])
    nth, code = rng.randint(1, 3), rng.choice([errno.EIO, errno.ENOSPC])
    calls = [0]
    ours = under(root)

    def hit(target: Any) -> bool:
        if not ours(target):
            return False
        calls[0] += 1
        return calls[0] == nth

    with pytest.MonkeyPatch.context() as m:
        if kind == "transfer":

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


def _store(
    rng: random.Random, store: DiskStore, pool: np.ndarray, key: bytes, model: _Model
) -> None:
    """Store ``key`` (removed first where it is on disk) from a DRAM slot given bytes no store
    had: the model learns of it once written."""
    if store.contains("ns", key):
        assert store.remove("ns", key)
        model.removed(key)
    dram = rng.randrange(DISK_POOL)  # no write in flight uses it: each is settled
    pool[dram, :8] = np.frombuffer(rng.randbytes(8), np.uint8)
    digest = digest_of(pool, dram, key)
    for _, evicted in store.write([("ns", key, digest, dram)]):
        model.removed(evicted)
    done = store.poll()  # a write refused as it starts: failed at the next poll
    if store.in_flight():
        done = settle(store)
    if done.written:
        model.stored(key, digest)


def _compact(store: DiskStore, f: int) -> None:
    store._dirs[f].records = 1 << 20  # past 4x the live keys: compacted
    store._dirs[f].retry_at = 0.0
    store.poll()


def _history(
    rng: random.Random, store: DiskStore, pool: np.ndarray, root: Path, model: _Model
) -> list[str]:
    """The random operations; what was done, for a failure's message."""
    done: list[str] = []
    for _ in range(rng.randint(6, 24)):
        op = rng.choices(["store", "remove", "sync", "compact", "poll"], [5, 2, 2, 1, 1])[0]
        key = rng.choice(KEYS)
        faults = rng.choices([0, 1, 2], [8, 2, 1])[0]
        with (
            _fault(rng, root, store) if faults > 0 else _noop() as fault,
            _fault(rng, root, store) if faults > 1 else _noop() as other,
        ):
            fault = " ".join(f for f in (fault, other) if f)
            if op == "store":
                _store(rng, store, pool, key, model)
            elif op == "remove" and store.remove("ns", key):
                model.removed(key)
            elif op == "sync" and store.sync(5.0):
                model.synced()
            elif op == "compact":
                f = rng.randrange(len(store._dirs))
                _compact(store, f)
                op = f"compact {f}"
                if store.sync(5.0):
                    model.synced()
            elif op == "poll":
                store.poll()
        if op in ("store", "remove"):
            op = f"{op} {key.decode()}"
        done.append(op + (f" [{fault}]" if fault else ""))
    return done


@contextmanager
def _noop() -> Iterator[str]:
    yield ""


def _started(pool: np.ndarray, dirs: list[Path]) -> dict[bytes, int]:
    with closing(open_store(pool, dirs, SLOTS)) as store:
        return {key: digest for _, key, digest in store.recover()}


def _check(found: dict[bytes, int], view: Any, clean: bool, what: str) -> None:
    acked, since, touched = view
    for key, digest in found.items():
        allowed = {acked.get(key)} | since.get(key, frozenset())
        assert digest in allowed, (
            f"{what}: {key!r} served with bytes of neither its last acknowledged store nor "
            f"one since ({digest:x} not in {allowed})"
        )
    if clean:  # nothing injected: every key acknowledged and untouched since is found
        for key, digest in acked.items():
            if digest is not None and key not in touched:
                assert found.get(key) == digest, f"{what}: {key!r} lost"


@dataclass
class _Kills:
    """The copies of one seed's directories (``copy_at_each_step``), each with what a start of
    it may serve (``_Model.view``, as the kill left it)."""

    copies: list[Path] = field(default_factory=list)
    views: list[Any] = field(default_factory=list)

    @contextmanager
    def at_each_step(self, d: Path, view: Callable[[], Any]) -> Iterator[list[int]]:
        """Copies of ``d`` at each of its file steps meanwhile; yields their indices, filled
        in as the block ends."""
        made: list[int] = []
        first = len(self.copies)
        with pytest.MonkeyPatch.context() as m:
            copy_at_each_step(m, d, self.copies, lambda: self.views.append(view()))
            yield made
        made += range(first, len(self.copies))


def _life(
    rng: random.Random, pool: np.ndarray, dirs: list[Path], kills: _Kills, done: list[str]
) -> list[int]:
    """A host started on ``dirs`` (a copy of ``kills``: checked against its view; else new),
    then a random history; the indices of ``kills``' copies of ``dirs`` at each of its file
    steps, and after its last operation."""
    root, model = dirs[0].parent, _Model()
    store = open_store(pool, dirs, SLOTS)
    try:
        found = {key: digest for _, key, digest in store.recover()}
        if root in kills.copies:
            view = kills.views[kills.copies.index(root)]
            _check(found, view, "[" not in " ".join(done), f"{'; '.join(done)}; started")
        model.now = dict(found)
        model.synced()  # a start's journals are rewritten, synced
        with kills.at_each_step(root, model.view) as made:
            done += _history(rng, store, pool, root, model)
        assert store._journals.wait(10.0), "a journal job still runs after 10 s"
        made.append(len(kills.copies))  # killed after the last operation, its files at rest
        kills.copies.append(root.parent / f"killed-{made[-1]}")
        kills.views.append(model.view())
        shutil.copytree(root, kills.copies[-1])
    finally:
        store.close()
    return made


def _started_twice(pool: np.ndarray, dirs: list[Path], view: Any, clean: bool, what: str) -> None:
    found = _started(pool, dirs)
    _check(found, view, clean, what)
    assert _started(pool, dirs) == found, f"{what}; the second start differs from the first"


def fuzz(seed: int, pool: np.ndarray, tmp: Path, kills: int = 3) -> None:
    """One seed's lives (1 to 3, each started on a copy its last left at a random step), then
    ``kills`` of the last life's file steps (module docstring) each started (killed at one of
    its steps, at each for one of them), started twice; raises ``AssertionError`` saying what
    was done where the invariant breaks."""
    rng = random.Random(seed)
    tmp = tmp / f"seed-{seed}"
    names = ["a", "b"][: rng.randint(1, 2)]
    done = [f"seed {seed}, {len(names)} directories"]
    copies = _Kills()
    made = _life(rng, pool, [tmp / "dirs" / n for n in names], copies, done)
    for _ in range(rng.randint(0, 2)):
        at = rng.choice(made)
        done.append(f"killed ({copies.copies[at].name} of {len(made)}), started")
        made = _life(rng, pool, [copies.copies[at] / n for n in names], copies, done)
    clean = "[" not in " ".join(done)
    chosen = rng.sample(made, min(kills, len(made)))
    for at in chosen:
        where, view = copies.copies[at], copies.views[at]
        what = f"{'; '.join(done)}; killed ({where.name} of {len(made)})"
        with copies.at_each_step(where, lambda: None) as again:
            first = _started(pool, [where / n for n in names])
        _check(first, view, clean, f"{what}; first start")
        assert _started(pool, [where / n for n in names]) == first, f"{what}; second start"
        steps = again if at == chosen[0] else rng.sample(again, len(again[:1]))
        for step in steps:
            dirs = [copies.copies[step] / n for n in names]
            _started_twice(pool, dirs, view, False, f"{what}; its start killed at {step}")
    shutil.rmtree(tmp)


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_a_random_history_killed_anywhere_serves_no_bytes_but_the_last_acknowledged(
    disk_pool: np.ndarray, tmp_path: Path, seed: int
) -> None:
    fuzz(seed, disk_pool, tmp_path)
