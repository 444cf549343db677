"""A model-based crash fuzzer of the disk tier's restart path: per seed, a random history of a
few keys over one or two directories (stores, removals, stores again with other bytes, journal
syncs, forced compactions; with two, moves of a key from one directory to the other, whose old
copy's ``DEL`` is lost as often as not: a key in two directories), with write, sync, rename and
removal failures injected (EIO, ENOSPC, a block write refused; up to three at once), the host
killed at a random file step (``copy_at_each_step``: the directories as that step leaves them; a
move's steps, and the copy right after it, chosen more often), started on that copy (one time in
three turned into disk format 1 or 2 first: a migration; one time in four with one to three
failures injected as it recovers, a block's read or overwrite too), for one to three such lives.
Then some copies of the last life are started (each start killed at a random step, at every step
for one copy, and that copy started), each started twice; one of them is also started with one
to three failures injected as it opens, recovers and closes (``_faulted_start``), then started
twice, as are copies of that faulted start killed at a few of its steps. Each start may serve a
key only with the bytes of its last store acknowledged (a ``sync`` that returned True after it)
before the kill, or of a store since (or, after a faulted recovery, those its journal named
then, until a store or removal of it is acknowledged); a key whose removal was acknowledged
never comes back; a second start serves what the first did; a history with nothing injected
loses no key acknowledged and untouched since.

``TKVT_DISK_FUZZ_SEEDS`` runs more seeds (default 6), from ``TKVT_DISK_FUZZ_FIRST`` (default 0),
e.g. ``TKVT_DISK_FUZZ_SEEDS=500 pytest tests/test_disk_fuzz.py``."""

from __future__ import annotations

import json
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
from disk_fuzz_model import Model, allowed_digests, check_found, inject_faults
from disk_support import (
    DISK_POOL,
    as_format,
    copy_at_each_step,
    digest_of,
    failing_eio,
    open_store,
    settle,
    under,
)

from torch_kv_tier.remote.disk_frames import parse
from torch_kv_tier.remote.disk_journal import DiskError
from torch_kv_tier.remote.disk_store import DiskStore

SEEDS = int(os.environ.get("TKVT_DISK_FUZZ_SEEDS", "6"))
FIRST = int(os.environ.get("TKVT_DISK_FUZZ_FIRST", "0"))
KEYS = [b"A", b"B", b"C", b"D"]
SLOTS = 8  # per directory: the keys never evict one another


def _store(
    rng: random.Random, store: DiskStore, pool: np.ndarray, key: bytes, model: Model
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


def _move(rng: random.Random, store: DiskStore, pool: np.ndarray, key: bytes, model: Model) -> str:
    """Store ``key`` again from directory 1 into directory 0 (first into 1 where it is in
    neither), then sync. As often as not, the old copy's ``DEL`` is lost (all else synced
    before; it is flushed at the write's first poll): directory 1's journal write, its
    emptying and its removal fail (EIO), the sync says False for it (``DiskDir.unsafe``) but
    syncs directory 0's journal all the same (the new copy acknowledged), and the old copy stays
    named after the new one is acknowledged, a key in two directories (the state
    ``disk_recovery`` drops, ``_spoil``), until ``_rewritten``. What was injected, for a
    failure's message."""
    entry = store._index.where.get(("ns", key))
    moved = entry is not None and entry[0] % 2 == 1
    # the new copy goes to directory 0 (not failing), nothing else is pending
    lose = moved and 0 not in store._index.failing and rng.random() < 0.5 and store.sync(5.0)
    if lose:
        model.synced()
    store._index._turn = 0 if moved else 1
    with pytest.MonkeyPatch.context() as m:
        if lose:  # from the removal on: the DEL is flushed at the write's first poll
            ours = under(store._dirs[1].path)
            for name in ("write", "ftruncate", "unlink"):
                m.setattr(os, name, failing_eio(getattr(os, name), ours))
        _store(rng, store, pool, key, model)
        if lose:
            entry = store._index.where.get(("ns", key))
            assert entry is not None and entry[0] % 2 == 0, "not moved to directory 0"
        synced = store.sync(5.0)
        assert not (lose and synced), "sync said done, though a DEL was lost"
        if synced or lose and store._dirs[1].unsafe and store._journals.wait(10.0):
            model.synced()
    assert store._journals.wait(10.0), "a journal job still runs after 10 s"
    return "DEL lost" if lose else ""


def _rewritten(store: DiskStore) -> None:
    """Directory 1's journal, which lost a ``DEL`` (``_move``), rewritten: until then it
    drops every record, and a removal lost where the journal could be neither emptied nor
    removed is a fault the tier does not guard (logged, and ``sync`` says False: a restart may
    bring the key back)."""
    store._dirs[1].retry_at = 0.0
    assert store.sync(5.0) and not store._dirs[1].stale, "a journal not rewritten"


def _history(
    rng: random.Random,
    store: DiskStore,
    pool: np.ndarray,
    root: Path,
    model: Model,
    marking: Callable[[], Any],
) -> list[str]:
    """The random operations; what was done, for a failure's message. A move's file steps
    are copied under ``marking`` (``_Kills.marking``)."""
    done: list[str] = []
    two = len(store._dirs) == 2
    for _ in range(rng.randint(6, 24)):
        weights = [5, 2, 2, 1, 1, 3 if two else 0]
        op = rng.choices(["store", "remove", "sync", "compact", "poll", "move"], weights)[0]
        key = rng.choice(KEYS)
        faults = 0 if op == "move" else rng.choices([0, 1, 2, 3], [8, 2, 1, 1])[0]
        with inject_faults(rng, root, store, faults) as fault:
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
            elif op == "move":
                with marking() as lost_del:
                    lost = _move(rng, store, pool, key, model)
                    lost_del.append(bool(lost))
                if lost:
                    _rewritten(store)
                fault = " ".join(f for f in (fault, lost) if f)
        if op in ("store", "remove", "move"):
            op = f"{op} {key.decode()}"
        done.append(op + (f" [{fault}]" if fault else ""))
    return done


def _started(pool: np.ndarray, dirs: list[Path]) -> dict[bytes, int]:
    with closing(open_store(pool, dirs, SLOTS)) as store:
        return {key: digest for _, key, digest in store.recover()}


@dataclass
class _Kills:
    """The copies of one seed's directories (``copy_at_each_step``), each with what a start of
    it may serve (``Model.view``, as the kill left it)."""

    copies: list[Path] = field(default_factory=list)
    views: list[Any] = field(default_factory=list)
    marked: set[int] = field(default_factory=set)  # copies made as a move ran (``_move``)
    lost: set[int] = field(default_factory=set)  # at rest after a move that lost its DEL:
    # one of them, of any life, is the copy whose start is killed at each step (``fuzz``)

    @contextmanager
    def marking(self, root: Path, view: Callable[[], Any]) -> Iterator[list[bool]]:
        """Mark the copies made meanwhile, and one of ``root`` at rest after (``view`` what it
        may serve): killed right after, as it was left; that one as ``lost`` where the block
        appends True to what it is given (a ``DEL`` lost)."""
        first, flags = len(self.copies), list[bool]()
        yield flags
        self.copies.append(root.parent / f"killed-{len(self.copies)}")
        self.views.append(view())
        shutil.copytree(root, self.copies[-1])
        self.marked.update(range(first, len(self.copies)))
        if any(flags):
            self.lost.add(len(self.copies) - 1)

    def pick(self, rng: random.Random, made: list[int], count: int) -> list[int]:
        """``count`` of ``made`` (fewer where there are fewer), each drawn from the marked ones
        as often as not (where any is left): a kill in the middle of a move."""
        left, chosen = list(made), list[int]()
        while left and len(chosen) < count:
            marked = [i for i in left if i in self.marked]
            at = rng.choice(marked if marked and rng.random() < 0.5 else left)
            left.remove(at)
            chosen.append(at)
        return chosen

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
    root, model = dirs[0].parent, Model()
    store = open_store(pool, dirs, SLOTS)
    try:
        # one time in four, one to three failures while it recovers (its journals maybe not
        # rewritten, its blocks not read or overwritten)
        with inject_faults(
            rng, root, None, rng.randint(1, 3) if rng.random() < 0.25 else 0
        ) as fault:
            found = {key: digest for _, key, digest in store.recover()}
        done += [f"recovered [{fault}]"] if fault else []
        view = kills.views[kills.copies.index(root)] if root in kills.copies else None
        if view is not None:
            check_found(found, view, "[" not in " ".join(done), f"{'; '.join(done)}; started")
        model.now = dict(found)
        model.synced()  # a start's journals are rewritten, synced
        if fault and view is not None:  # or maybe not: what they named may come back
            model.maybe = {
                key: frozenset(d for d in allowed_digests(view, key) if d is not None)
                for key in KEYS
            }
        with kills.at_each_step(root, model.view) as made:
            marking = lambda: kills.marking(root, model.view)  # noqa: E731
            done += _history(rng, store, pool, root, model, marking)
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
    check_found(found, view, clean, what)
    assert _started(pool, dirs) == found, f"{what}; the second start differs from the first"


def _aged(rng: random.Random, dirs: list[Path]) -> str:
    """One time in three, ``dirs`` (a host's, killed) turned into what disk format 1 or 2 made
    (``as_format``: its next start migrates them), where each has a ``meta.json`` and a whole
    journal of the generation it names; what was done, for a failure's message."""
    if rng.random() >= 1 / 3:
        return ""
    for d in dirs:
        try:
            generation = json.loads((d / "meta.json").read_text())["generation"]
            whole = parse((d / "journal.log").read_bytes(), generation=generation).bad_at is None
        except (OSError, ValueError, KeyError):
            return ""
        if not whole:
            return ""
    fmt = rng.choice([1, 2])
    for d in dirs:
        as_format(d, fmt)
    return f" as format {fmt}"


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
        (at,) = copies.pick(rng, made, 1)
        copies.lost.discard(at)  # its life writes it: no longer as killed
        dirs = [copies.copies[at] / n for n in names]
        done.append(f"killed ({copies.copies[at].name} of {len(made)}){_aged(rng, dirs)}, started")
        made = _life(rng, pool, dirs, copies, done)
    clean = "[" not in " ".join(done)
    chosen = copies.pick(rng, made, kills)
    if copies.lost and rng.random() < 0.75:  # killed at each step: a start's, of either life
        chosen = [rng.choice(sorted(copies.lost)), *[at for at in chosen if at not in copies.lost]]
    for at in chosen:
        where, view = copies.copies[at], copies.views[at]
        what = f"{'; '.join(done)}; killed ({where.name} of {len(made)})"
        with copies.at_each_step(where, lambda: None) as again:
            first = _started(pool, [where / n for n in names])
        check_found(first, view, clean, f"{what}; first start")
        assert _started(pool, [where / n for n in names]) == first, f"{what}; second start"
        steps = again if at == chosen[0] else rng.sample(again, len(again[:1]))
        for step in steps:
            dirs = [copies.copies[step] / n for n in names]
            _started_twice(pool, dirs, view, False, f"{what}; its start killed at {step}")
        if at == chosen[0]:
            _faulted_start(rng, pool, copies, at, names, what)
    shutil.rmtree(tmp)


def _faulted_start(
    rng: random.Random, pool: np.ndarray, kills: _Kills, at: int, names: list[str], what: str
) -> None:
    """A copy of ``kills``' copy ``at`` started with one to three failures injected
    (``inject_faults``) while it opens its directories, recovers, syncs and closes (a start
    refused is one outcome), then started twice; and started twice as that faulted start left
    it at a few of its file steps (killed there)."""
    view, source = kills.views[at], kills.copies[at]
    where = source.parent / f"{source.name}-faulted"
    shutil.copytree(source, where)
    dirs = [where / n for n in names]
    with (
        kills.at_each_step(where, lambda: None) as again,
        inject_faults(rng, where, None, rng.randint(1, 3)) as fault,
    ):
        what = f"{what}; started with [{fault}]"
        try:
            store = open_store(pool, dirs, SLOTS)
        except DiskError:
            found: dict[bytes, int] = {}  # refused: serves nothing
        else:
            with closing(store):
                found = {key: digest for _, key, digest in store.recover()}
                store.sync(5.0)
    check_found(found, view, False, what)
    _started_twice(pool, dirs, view, False, f"{what}; started again")
    for step in rng.sample(again, min(2, len(again))):
        dirs = [kills.copies[step] / n for n in names]
        _started_twice(pool, dirs, view, False, f"{what}; killed at {step}")


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_a_random_history_killed_anywhere_serves_no_bytes_but_the_last_acknowledged(
    disk_pool: np.ndarray, tmp_path: Path, seed: int
) -> None:
    fuzz(seed, disk_pool, tmp_path)
