"""A model-based crash fuzzer of the disk tier's restart path: per seed, a random history of a
few keys over one or two directories (stores, removals, stores again with other bytes, journal
syncs, forced compactions), with write, sync and rename failures injected (EIO, ENOSPC, a block
write refused), and the host killed at a random file step (the directories copied as that step
leaves them, as ``test_disk_crash_points`` does); the copy is started, maybe killed again at a
random step of that start, then started twice. Each start may serve a key only with the bytes of
its last store acknowledged (a ``sync`` that returned True after it) before the kill, or of a
store since; a key whose removal was acknowledged never comes back; the second start serves what
the first did; a history with nothing injected loses no key acknowledged and untouched since.

``TKVT_DISK_FUZZ_SEEDS`` runs more seeds (default 8), from ``TKVT_DISK_FUZZ_FIRST`` (default 0),
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
from disk_support import DISK_POOL, digest_of, open_store, settle

from torch_kv_tier.remote.disk_store import DiskStore

SEEDS = int(os.environ.get("TKVT_DISK_FUZZ_SEEDS", "8"))
FIRST = int(os.environ.get("TKVT_DISK_FUZZ_FIRST", "0"))
KEYS = [b"A", b"B", b"C", b"D"]
SLOTS = 8  # per directory: the keys never evict one another
FILE_STEPS = ("write", "pwritev", "fsync", "fdatasync", "ftruncate")


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


def _ours(root: Path) -> Callable[[Any], bool]:
    def of_root(fd: Any) -> bool:
        if not isinstance(fd, int):
            return root in Path(fd).parents
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
        except OSError:
            return False

    return of_root


@contextmanager
def _killed_anywhere(root: Path, view: Callable[[], Any]) -> Iterator[list[tuple[Path, Any]]]:
    """Copy ``root`` at each of its file steps (a write, sync, truncation, or either side of a
    rename, as ``test_disk_crash_points._snapshots`` does): each copy is the directories of a
    host killed at that step. Yields the list of each copy with what ``view`` said then."""
    out: list[tuple[Path, Any]] = []
    ours = _ours(root)

    def snap() -> None:
        out.append((root.parent / f"{root.name}-killed-{len(out)}", view()))
        shutil.copytree(root, out[-1][0])

    with pytest.MonkeyPatch.context() as m:
        for name in FILE_STEPS:
            real = getattr(os, name)

            def before(fd: int, *args: Any, _real: Any = real) -> Any:
                if ours(fd):
                    snap()
                return _real(fd, *args)

            m.setattr(os, name, before)
        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:
            mine = ours(dst)
            if mine:
                snap()
            real_replace(src, dst)
            if mine:
                snap()

        m.setattr(os, "replace", replace)
        yield out


@contextmanager
def _fault(rng: random.Random, root: Path, store: DiskStore) -> Iterator[str]:
    """One failure injected for an operation: the n-th file call of one kind under ``root``
    (a write, sync, truncation, rename or removal) raises EIO or ENOSPC, or a block write is
    refused as it starts."""
    kind = rng.choice([*FILE_STEPS[:1], *FILE_STEPS[2:], "replace", "unlink", "transfer"])
    nth, code = rng.randint(1, 3), rng.choice([errno.EIO, errno.ENOSPC])
    calls = [0]
    ours = _ours(root)

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


def _life(
    rng: random.Random, pool: np.ndarray, dirs: list[Path], view: Any, done: list[str]
) -> list[tuple[Path, Any]]:
    """A host started on ``dirs`` (checked against ``view``, what the kill before left: None
    for new ones), then a random history; a copy of ``dirs`` at each of its file steps, and
    after its last, with what a start of each may serve."""
    root, model = dirs[0].parent, _Model()
    store = open_store(pool, dirs, SLOTS)
    try:
        found = {key: digest for _, key, digest in store.recover()}
        if view is not None:
            _check(found, view, "[" not in " ".join(done), f"{'; '.join(done)}; started")
        model.now = dict(found)
        model.synced()  # a start's journals are rewritten, synced
        with _killed_anywhere(root, model.view) as killed:
            done += _history(rng, store, pool, root, model)
        assert store._journals.wait(10.0), "a journal job still runs after 10 s"
        killed.append((root.parent / f"{root.name}-killed-end", model.view()))
        shutil.copytree(root, killed[-1][0])  # killed after the last operation, files at rest
    finally:
        store.close()
    return killed


def fuzz(seed: int, pool: np.ndarray, tmp: Path, kills: int = 3) -> None:
    """One seed's lives (1 to 3, each started on a copy its last left at a random step), then
    ``kills`` of the last life's file steps (module docstring) each started, killed at a step
    of that start, started twice; raises ``AssertionError`` saying what was done where the
    invariant breaks."""
    rng = random.Random(seed)
    tmp = tmp / f"seed-{seed}"
    names = ["a", "b"][: rng.randint(1, 2)]
    done = [f"seed {seed}, {len(names)} directories"]
    killed = _life(rng, pool, [tmp / "dirs" / n for n in names], None, done)
    for _ in range(rng.randint(0, 2)):
        at = rng.randrange(len(killed))
        done.append(f"killed at step {at} of {len(killed)}, started")
        where, view = killed[at]
        killed = _life(rng, pool, [where / n for n in names], view, done)
    clean = "[" not in " ".join(done)
    chosen = sorted(rng.sample(range(len(killed)), min(kills, len(killed))))
    every = rng.choice(chosen)  # its start killed at each of its steps, the others' at one
    for at in chosen:
        where, view = killed[at]
        what = f"{'; '.join(done)}; killed at step {at} of {len(killed)}"
        with _killed_anywhere(where, lambda: None) as again:
            first = _started(pool, [where / n for n in names])
        _check(first, view, clean, f"{what}; first start")
        assert _started(pool, [where / n for n in names]) == first, f"{what}; second start"
        steps = range(len(again)) if at == every else rng.sample(range(len(again)), len(again[:1]))
        for step in steps:
            found = _started(pool, [again[step][0] / n for n in names])
            killed_too = f"{what}; the first start killed at its step {step} of {len(again)}"
            _check(found, view, False, killed_too)
            if at != every:
                assert _started(pool, [again[step][0] / n for n in names]) == found, killed_too
    shutil.rmtree(tmp)


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_a_random_history_killed_anywhere_serves_no_bytes_but_the_last_acknowledged(
    disk_pool: np.ndarray, tmp_path: Path, seed: int
) -> None:
    fuzz(seed, disk_pool, tmp_path)
