"""Helpers shared by the arena-batch tests (``test_arena_*``): a scripted tier whose store
futures resolve when a test says, no page copies, the arenas' clock, futures that a Ctrl-C
lands on, a Ctrl-C at any line (``ctrl_c_at_line``)."""

from __future__ import annotations

import contextlib
import linecache
import sys
import types
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.integrations.torch_loop import arena_batches, arena_slots, host_shares
from torch_kv_tier.integrations.torch_loop.arena_batches import ArenaBatches
from torch_kv_tier.keys import Key, home_peer
from torch_kv_tier.results import TransferResult

WAIT_S = 60.0  # the deadline of an offload that must not wait for it


def stored(keys: list[Key]) -> TransferResult:
    return TransferResult(ok=True, keys=list(keys), failed={}, nbytes=0, seconds=0.0)


class ScriptedTier:
    """The calls ``ArenaBatches`` makes of a ``TierManager``: stores with a key on a
    ``frozen`` host (``None``: any) stay under way until the test resolves them (``stores``);
    loads find every key."""

    def __init__(self, slots: int, peers: list[str], frozen: set[str] | None = None) -> None:
        self.arena = BlockArena(slots, 64)
        self._peers = peers
        self._frozen = frozen
        self.stores: list[tuple[list[Key], Future[TransferResult]]] = []
        self.gates: list[Future[TransferResult]] = []  # ``withheld_until``'s next answers

    def placing_peers(self) -> list[str]:
        return list(self._peers)

    def holders(self, keys: list[Key]) -> list[str | None]:
        return [home_peer(k, self._peers) for k in keys]

    def store(
        self, keys: list[Key], slots: list[int], placed: list[str] | None = None
    ) -> Future[TransferResult]:
        future: Future[TransferResult] = Future()
        under_way = next((f for ks, f in self.stores if not f.done() and ks == keys), None)
        if under_way is not None:  # keys in flight join their store, as TierManager's do
            under_way.add_done_callback(lambda _: future.set_result(stored(keys)))
            return future
        self.stores.append((list(keys), future))
        if placed is not None:
            placed.extend(dict.fromkeys(h for h in self.holders(keys) if h is not None))
        if self._frozen is not None and self._frozen.isdisjoint(self.holders(keys)):
            future.set_result(stored(keys))
        return future

    def load(
        self, keys: list[Key], slots: list[int], begun: list[Future[TransferResult]] | None = None
    ) -> Future[TransferResult]:
        future: Future[TransferResult] = Future()
        if begun is not None:
            begun.append(future)  # before its read begins, as TierManager.load's
        future.set_result(stored(keys))
        return future

    def withheld_until(self, slots: list[int]) -> Future[TransferResult]:
        """Resolved at once unless the test put a gate here (``gates``: the next call's)."""
        if self.gates:
            return self.gates.pop(0)
        future: Future[TransferResult] = Future()
        future.set_result(stored([]))
        return future

    def end_stores(self) -> None:
        for keys, future in self.stores:
            if not future.done():
                future.set_result(stored(keys))


class NoCopies:
    def gather(self, pages: list[int], slots: list[int]) -> None:
        pass

    def scatter(self, slots: list[int], pages: list[int]) -> None:
        pass


def batches(tier: ScriptedTier, timeout: float) -> ArenaBatches:
    return ArenaBatches(tier, NoCopies(), timeout)  # type: ignore[arg-type]


def keys_on(host: str, peers: list[str], count: int) -> list[Key]:
    """``count`` keys whose home among ``peers`` is ``host``."""
    return [k for k in (f"key-{i}".encode() for i in range(200)) if home_peer(k, peers) == host][
        :count
    ]


def failures(parts: list[tuple[list[Key], Future[TransferResult]]]) -> dict[Key, str]:
    return {k: r for _, part in parts if part.done() for k, r in part.result().failed.items()}


class Clock:
    """The ``time`` of the arena's modules: ``monotonic`` stands still until the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def on_the_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """A :class:`Clock` that the arena's modules read for ``time``."""
    clock = Clock()
    for module in (arena_slots, arena_batches, host_shares):
        monkeypatch.setattr(module, "time", clock)
    return clock


class CtrlCAsItsCallbacksRun(Future[TransferResult]):
    """A store's future resolved on the caller's thread, Ctrl-C landing before its callbacks
    ran (at a callback's first line, or anywhere before it ended the store)."""

    def _invoke_callbacks(self) -> None:
        raise KeyboardInterrupt


class ReadPastTheDeadline:
    """The tier's load of a read begun just before its restore's deadline, on the test's
    clock: the clock moves past the deadline, the read stays under way (``read``)."""

    def __init__(self, clock: Clock, read: Future[TransferResult]) -> None:
        self._clock, self.read = clock, read
        self.calls = 0

    def __call__(
        self, keys: list[Key], slots: list[int], begun: list[Future[TransferResult]] | None = None
    ) -> Future[TransferResult]:
        self._clock.now += 1.0
        self.calls += 1
        return self.read


@contextlib.contextmanager
def ctrl_c_at_line(
    where: dict[types.CodeType, set[int] | None], *at: int | str
) -> Iterator[list[str]]:
    """Trace (``sys.settrace``) the lines of ``where`` (code: its lines, ``None``: all;
    comprehensions in it too), raising ``KeyboardInterrupt`` at each of ``at`` in turn: the
    ``at``-th line run (an int), or the next line run that holds ``at`` (a str); yields the
    lines run. Not at a ``with``, ``try``, ``except`` or ``finally`` line: a signal lands at
    none of them (and one raised as a ``with`` exits would leave its lock held). A trace
    function that raises is turned off, so a profile function (``sys.setprofile``) turns it
    on again at the next call or return, for every frame of ``where`` under way: a second
    Ctrl-C lands in the handler of the first (from its first call on)."""
    nested = {
        inner: None
        for code in where
        for inner in code.co_consts
        if isinstance(inner, types.CodeType)
    }
    traced = {**nested, **where}
    seen: list[str] = []
    todo = list(at)
    rearm = False

    def local(frame: types.FrameType, event: str, arg: object) -> object:
        nonlocal rearm
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        lines = traced[frame.f_code]
        if (
            todo
            and event == "line"
            and (lines is None or frame.f_lineno in lines)
            and not line.startswith(("with ", "try:", "except", "finally:"))
        ):
            seen.append(line)
            if todo[0] == len(seen) or (isinstance(todo[0], str) and todo[0] in line):
                del todo[0]
                rearm = bool(todo)
                raise KeyboardInterrupt
        return local if todo else None

    def trace(frame: types.FrameType, event: str, arg: object) -> object:
        return local if todo and frame.f_code in traced else None

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        nonlocal rearm
        if rearm:
            rearm = False
            under_way: types.FrameType | None = frame
            while under_way is not None:
                if under_way.f_code in traced:
                    under_way.f_trace = local
                under_way = under_way.f_back
            sys.settrace(trace)

    sys.setprofile(profile)
    sys.settrace(trace)
    try:
        yield seen
    finally:
        sys.settrace(None)
        sys.setprofile(None)
