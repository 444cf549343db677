"""What every benchmarked system implements, and the block plans and byte patterns they share.

A *call* moves ``batch`` blocks between the system's local arena and a remote block pool: local
slots ``local``, remote slots ``remote`` (for systems the caller places: absolute slots of the
remote pool, inside the system's lease) and logical ``keys`` (for systems that place blocks
themselves, such as the tier). The sweep keeps up to ``inflight`` calls outstanding,
submitting with ``System.submit`` and collecting completions with ``System.reap``.

Threading: a ``System`` is driven from one thread; implementations may use their own threads
internally (the tier's completion thread) and say so.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

Op = Literal["write", "read"]
Pattern = Literal["contiguous", "scattered"]
OPS: tuple[Op, ...] = ("write", "read")
PATTERNS: tuple[Pattern, ...] = ("contiguous", "scattered")

# How a system's remote slots are chosen for a call (see ``Plan``):
#   "mirror":  one contiguous remote run per call, the placement our tier aims for (caller-placed
#              floors and ceilings: nixl_raw, memcpy, mooncake_tcp);
#   "pattern": remote slots drawn like the local ones (a reference tier that sends whatever slots
#              its peer's allocator handed out: vllm_nixl);
#   "system":  the system picks remote slots itself from logical keys (torch_kv_tier).
RemoteLayout = Literal["mirror", "pattern", "system"]


class Skip(Exception):
    """A system cannot run here (not installed, no GPU, op unsupported); the message says why."""


class TransferFailed(RuntimeError):
    """A benchmarked transfer failed: the point is reported as an error, never as a number."""


class Call:
    """One submission: ``local[i]`` pairs with ``remote[i]`` (or ``keys[i]``).

    ``local``/``remote`` are int32 arrays (what NIXL takes); ``local_list``/``remote_list`` the
    same indices as Python lists (what list-taking APIs take), built once per plan so that no
    system pays a conversion inside the timed loop. Remote indices are absolute slots of the
    system's remote pool (its lease already applied).
    """

    __slots__ = ("_spans", "keys", "local", "local_list", "remote", "remote_list")

    def __init__(self, local: np.ndarray, remote: np.ndarray, keys: Sequence[int] = ()) -> None:
        self.local = local.astype(np.int32)
        self.remote = remote.astype(np.int32)
        self.local_list: list[int] = self.local.tolist()
        self.remote_list: list[int] = self.remote.tolist()
        self.keys = keys
        self._spans: list[tuple[int, int, int]] | None = None

    def with_keys(self, keys: Sequence[int]) -> Call:
        """The same slots under other keys (no copies)."""
        call = Call.__new__(Call)
        call.local, call.remote = self.local, self.remote
        call.local_list, call.remote_list = self.local_list, self.remote_list
        call._spans = self._spans
        call.keys = keys
        return call

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        """``(local_start, remote_start, length)`` runs contiguous on both sides (cached): the
        merging NIXL does inside ``make_prepped_xfer``, for systems that copy by range."""
        if self._spans is None:
            self._spans = list(runs(self.local, self.remote))
        return self._spans

    def __len__(self) -> int:
        return len(self.local)


class System(ABC):
    """One system under test, opened for one block length.

    Subclasses set ``name``, ``ops`` and ``remote_layout``; their constructor allocates the local
    arena ``local`` (``[local_slots, block_len]`` uint8, on the benchmark device) and gets a
    remote pool (slots ``remote_base .. remote_base + remote_slots - 1``), or raises ``Skip`` with
    the reason. Calls never mix ops in flight.
    """

    name: ClassVar[str]
    ops: ClassVar[tuple[Op, ...]] = OPS
    remote_layout: ClassVar[RemoteLayout] = "mirror"
    path: str = "host"  # which data path the rows of this system measure ("host", "vram", ...)

    local: torch.Tensor
    remote_slots: int
    remote_base: int = 0

    @abstractmethod
    def submit(self, op: Op, call: Call) -> Hashable:
        """Start ``call``; return a token that ``reap`` reports once it completes."""

    @abstractmethod
    def reap(self, timeout: float) -> list[tuple[Hashable, float]]:
        """Completed tokens with their ``time.perf_counter()`` completion times.

        Waits up to ``timeout`` seconds for at least one completion (may return none). Raises
        ``TransferFailed`` when any outstanding call failed.
        """

    def fetch(self, calls: Sequence[Call], scratch: Sequence[np.ndarray]) -> None:
        """Copy the remote blocks of ``calls`` into local slots ``scratch[i]`` (verification).

        The default reads them back through the system itself; a write-only system overrides it.
        """
        reads = [Call(s, c.remote, c.keys) for c, s in zip(calls, scratch, strict=True)]
        drain(self, "read", reads, timeout=60.0)

    @abstractmethod
    def close(self) -> None:
        """Release everything the system holds (arenas, registrations, processes). Idempotent."""


def drain(system: System, op: Op, calls: Sequence[Call], timeout: float) -> None:
    """Run ``calls`` one at a time to completion (untimed staging and read-back)."""
    for call in calls:
        token = system.submit(op, call)
        deadline = time.monotonic() + timeout
        while not any(t == token for t, _ in system.reap(0.05)):
            if time.monotonic() > deadline:
                raise TransferFailed(f"{system.name}: staging {op} did not finish in {timeout} s")


# -- block plans ---------------------------------------------------------------------------------


def fragmented_free_list(num_slots: int, mean_run: float, rng: np.random.Generator) -> np.ndarray:
    """Slots ``0..num_slots-1`` in the order a long-running allocator's free list hands them out.

    Requests free their blocks in runs; after enough churn the free list is those runs in random
    order. Run lengths are geometric with mean ``mean_run`` (1 gives a plain permutation).
    """
    if mean_run < 1:
        raise ValueError(f"mean run length must be >= 1, got {mean_run}")
    lengths: list[int] = []
    total = 0
    while total < num_slots:
        n = int(min(rng.geometric(1.0 / mean_run), num_slots - total))
        lengths.append(n)
        total += n
    starts = np.cumsum([0, *lengths[:-1]])
    order = rng.permutation(len(lengths))
    return np.concatenate(
        [np.arange(starts[i], starts[i] + lengths[i], dtype=np.int64) for i in order]
    )


def slot_order(pattern: Pattern, num_slots: int, mean_run: float, seed: int) -> np.ndarray:
    """The order in which a call sequence takes slots for ``pattern``."""
    if pattern == "contiguous":
        return np.arange(num_slots, dtype=np.int64)
    return fragmented_free_list(num_slots, mean_run, np.random.default_rng(seed))


@dataclass(frozen=True)
class Plan:
    """``len(calls)`` calls over disjoint slots; the sweep cycles through them.

    Local slots of the plan lie in ``[0, local_slots/2)``; the upper half of the local arena is
    scratch for read-back verification (``scratch[i]`` pairs with ``calls[i].local``).
    """

    calls: list[Call]
    scratch: list[np.ndarray]

    @property
    def local_slots(self) -> np.ndarray:
        return np.concatenate([c.local for c in self.calls])


def make_plan(
    *,
    pattern: Pattern,
    layout: RemoteLayout,
    batch: int,
    num_calls: int,
    local_slots: int,
    remote_slots: int,
    remote_base: int,
    mean_run: float,
    seed: int,
) -> Plan:
    """Build ``num_calls`` calls of ``batch`` blocks for one point.

    Local slots come from ``slot_order(pattern)`` over the lower half of the local arena; remote
    slots are contiguous runs (layout "mirror"), drawn like the local ones from an independent
    free list (layout "pattern"), or left to the system (layout "system"); they are offset by
    ``remote_base``.
    """
    half = local_slots // 2
    need = batch * num_calls
    if need > half or need > remote_slots:
        raise ValueError(
            f"plan of {num_calls} x {batch} blocks does not fit {half} local / {remote_slots} "
            "remote slots"
        )
    local_order = slot_order(pattern, half, mean_run, seed)[:need]
    if layout == "pattern":
        remote_order = slot_order(pattern, remote_slots, mean_run, seed + 1)[:need]
    else:
        remote_order = np.arange(need, dtype=np.int64)
    remote_order = remote_order + remote_base
    calls = []
    scratch = []
    for j in range(num_calls):
        part = slice(j * batch, (j + 1) * batch)
        calls.append(Call(local_order[part], remote_order[part]))
        scratch.append(np.arange(half + j * batch, half + (j + 1) * batch, dtype=np.int32))
    return Plan(calls, scratch)


def runs(local: np.ndarray, remote: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """Split paired indices into ``(local_start, remote_start, length)`` runs contiguous on both
    sides."""
    if len(local) == 0:
        return
    breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    bounds = [0, *breaks.tolist(), len(local)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        yield int(local[a]), int(remote[a]), b - a


# -- byte patterns -------------------------------------------------------------------------------

_CHUNK_BYTES = 32 << 20


@functools.lru_cache(maxsize=4)
def _base_row(seed: int, block_len: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (block_len,), dtype=torch.uint8, generator=gen).to(device)


def _pattern(seed: int, tags: torch.Tensor, block_len: int) -> torch.Tensor:
    """Blocks for ``tags``: a per-seed random row, shifted per tag, stamped with (seed, tag)."""
    base = _base_row(seed, block_len, tags.device)
    blocks = base.unsqueeze(0) + (tags % 251).to(torch.uint8).unsqueeze(1)
    if block_len >= 8:
        stamp = (tags.to(torch.int64) + (seed << 32)).unsqueeze(1)
        blocks[:, :8] = stamp.view(torch.uint8).view(-1, 8)
    return blocks


def _chunks(slots: np.ndarray, block_len: int) -> Iterator[np.ndarray]:
    step = max(1, _CHUNK_BYTES // block_len)
    for i in range(0, len(slots), step):
        yield slots[i : i + step]


def _settle(arena: torch.Tensor) -> None:
    """Wait for queued GPU work on ``arena``: NIXL and side streams read it directly."""
    if arena.is_cuda:
        torch.cuda.synchronize(arena.device)


def fill(arena: torch.Tensor, slots: np.ndarray, seed: int) -> None:
    """Write the pattern of ``seed`` into ``arena[slots]`` (tagged by slot number)."""
    for part in _chunks(slots, arena.shape[1]):
        idx = torch.from_numpy(part.astype(np.int64)).to(arena.device)
        arena[idx] = _pattern(seed, idx, arena.shape[1])
    _settle(arena)


def clear(arena: torch.Tensor, slots: np.ndarray) -> None:
    """Zero ``arena[slots]`` so that a later match proves the bytes were moved again."""
    for part in _chunks(slots, arena.shape[1]):
        arena[torch.from_numpy(part.astype(np.int64)).to(arena.device)] = 0
    _settle(arena)


def check(arena: torch.Tensor, slots: np.ndarray, tags: np.ndarray, seed: int) -> int:
    """Number of blocks ``arena[slots[i]]`` that differ from the pattern of ``tags[i]``."""
    bad = 0
    block_len = arena.shape[1]
    step = max(1, _CHUNK_BYTES // block_len)
    for i in range(0, len(slots), step):
        idx = torch.from_numpy(slots[i : i + step].astype(np.int64)).to(arena.device)
        tag = torch.from_numpy(tags[i : i + step].astype(np.int64)).to(arena.device)
        got = arena[idx]
        want = _pattern(seed, tag, block_len)
        if not torch.equal(got, want):
            bad += int((got != want).any(dim=1).sum())
    return bad
