"""``DiskStore``: a host's blocks on local files, written from and read into its DRAM pool through
NIXL's POSIX backend, with a journal that lets a restarted host find them again.

Each ``--disk`` directory is a ``disk_journal.DiskDir`` (block file, header, journal). Their
slots form one pool: global slot ``g`` is slot ``g // n`` of directory ``g % n``, so consecutive
allocations alternate between directories. ``write``/``read`` post one NIXL request per
directory touched (``disk_io.DiskTransfers``: no byte and no per-block call goes through
Python), ``poll`` collects them. Which keys are where, the LRU (``read`` marks a key used), the
free slots and the journal records of each change are the ``disk_index.DiskIndex``'s: a slot
with I/O in flight is never evicted, nor reused before that I/O ends.

Recovery (``recover``): the blocks the journals name that still verify (``disk_recovery``); the
journals are then rewritten with the live records only (LRU order). Afterwards the journals are
written, synced and compacted on a thread of their own (``disk_sync``): a hung device never stalls
the loop, nor does a compaction at any number of keys (its records are built a bounded part per
``poll``, in slot order).

Threading and failures: not thread-safe; the server's loop thread calls every method (``close`` may
run on another once the loop ended: on io_uring, requests the loop still had in flight were
cancelled as it exited, a write then not copied, a read failed with its key kept). An I/O error
drops the keys of that request from the disk (``poll().failed``), logged, never raised. A request
not done within ``request_timeout_s`` (a hung device, a stuck NFS mount) is given up
(``_give_up``; ``disk_stuck`` tracks it until it ends): its keys fail now, its slots are kept
until it ends; a read's keys stay on disk (a hang costs misses while it lasts, not the data)
unless it then ends failed (``_unstick``).
A directory whose last write failed takes only a probe now and then and loses no key for writes
(``DiskIndex.failing``): a failing disk costs the copies it cannot make, not the blocks it holds,
nor the copies its other directories can make. A directory with a request given up counts as
failing, and takes no write, not even a probe, until that request ends; a read there fails at
once but keeps its keys (``_finish``). Construction raises ``DiskError`` with what to do.
``close`` never frees what a request still in flight may touch (``close``).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_kv_tier.keys import Key
from torch_kv_tier.remote.disk_index import DiskIndex
from torch_kv_tier.remote.disk_io import DiskCompletions, DiskTransfers, Pair, Request, quietly
from torch_kv_tier.remote.disk_journal import DiskDir, DiskError
from torch_kv_tier.remote.disk_stuck import StuckRequests
from torch_kv_tier.remote.disk_sync import JournalSync
from torch_kv_tier.remote.slot_owners import SlotOwners

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0
REQUEST_TIMEOUT_S = 30.0  # a request not done by then is given up (a hung device, NFS)


class DiskStore:
    """Blocks on disk for one host (module docstring)."""

    def __init__(
        self,
        paths: Sequence[str],
        bytes_per_path: int,
        *,
        block_len: int,
        pool_addr: int,
        pool_blocks: int,
        name: str = "tkvt-disk",
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        pool_owner: Any = None,
    ) -> None:
        if bytes_per_path < block_len:
            raise ValueError(f"--disk-bytes {bytes_per_path} holds no block of {block_len} bytes")
        self.block_len = block_len
        self.request_timeout_s = request_timeout_s
        self._pool_owner = pool_owner  # what frees the pool once dropped (``close``)
        self._dirs: list[DiskDir] = []
        aligned = pool_addr % 4096 == 0  # else O_DIRECT would refuse every transfer
        try:
            for p in paths:
                self._dirs.append(DiskDir(Path(p), bytes_per_path, block_len, direct=aligned))
        except BaseException:
            self._close_files()
            raise
        self.direct_io = all(d.direct for d in self._dirs)
        self.capacity = len(self._dirs) * (bytes_per_path // block_len)
        self._index = DiskIndex(self._dirs, self.capacity)
        self._writing: set[Pair] = set()
        self._busy_dram: dict[int, int] = {}  # dram slot -> requests using it
        self._requests: list[Request] = []
        self._failed_at_start = DiskCompletions()  # requests NIXL refused: the next poll's
        self._counters = dict.fromkeys(
            (
                "disk_writes", "disk_reads", "disk_write_bytes", "disk_read_bytes",
                "disk_evictions", "disk_failures", "disk_recover_dropped", "disk_stuck",
            ),
            0,
        )  # fmt: skip
        self._busy_s = {"write": 0.0, "read": 0.0}
        self._closed = False
        try:
            self._io = DiskTransfers(
                [(d.fd, d.slots, str(d.path)) for d in self._dirs],
                block_len=block_len,
                pool_addr=pool_addr,
                pool_blocks=pool_blocks,
                name=name,
            )
        except BaseException:
            self._close_files()
            raise
        self._stuck = StuckRequests(self._io)  # given up, still in flight: their slots kept
        self._journals = JournalSync(self._dirs, f"{name}-journal")

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, namespace: str, key: Key) -> bool:
        return (namespace, key) in self._index.where

    def hung(self, namespace: str, key: Key) -> bool:
        """Whether ``key`` is on disk in a directory with a request given up still in flight
        (a hung device): a read of it is refused, a miss, until that request ends."""
        entry = self._index.where.get((namespace, key))
        return entry is not None and entry[0] % len(self._dirs) in self._stuck.dirs()

    def digest(self, namespace: str, key: Key) -> int | None:
        entry = self._index.where.get((namespace, key))
        return None if entry is None else entry[1]

    def slot_owners(self) -> SlotOwners:
        """The key of each global slot, with its write stamp."""
        return self._index.owners

    def busy_dram_slots(self) -> set[int]:
        return set(self._busy_dram)

    def in_flight(self) -> int:
        return len(self._requests)

    def compacting(self) -> bool:
        """Whether a journal's compaction is being built, a bounded part per ``poll``
        (``disk_sync``): poll often until it is done."""
        return self._journals.compacting()

    # -- I/O ----------------------------------------------------------------------------------

    def write(self, items: Sequence[tuple[str, Key, int, int]]) -> list[Pair]:
        """Post writes of DRAM slots to disk: ``(namespace, key, digest, dram_slot)``; keys on
        disk or being written are skipped. Returns the keys evicted from disk for room, none of
        a directory whose writes fail or with a request stuck (``DiskIndex.take_slot``: so that
        a failing or hung disk costs no key it holds, nor the copies the others can take)."""
        evicted: list[Pair] = []
        batch: list[tuple[str, Key, int, int, int]] = []
        now, stuck = time.monotonic(), self._stuck.dirs()
        for ns, key, digest, dram in items:
            pair = (ns, key)
            if pair in self._index.where or pair in self._writing:
                continue
            slot = self._index.take_slot(evicted, now, stuck)
            if slot is None:
                break
            self._writing.add(pair)
            batch.append((ns, key, digest, slot, dram))
        self._counters["disk_evictions"] += len(evicted)
        if batch:
            self._post("write", batch)
        return evicted

    def read(self, items: Sequence[tuple[str, Key, int]]) -> list[Pair]:
        """Post reads of keys' disk copies into DRAM slots: ``(namespace, key, dram_slot)``.
        Returns the keys skipped (not on disk)."""
        skipped: list[Pair] = []
        batch: list[tuple[str, Key, int, int, int]] = []
        for ns, key, dram in items:
            entry = self._index.used((ns, key))
            if entry is None:
                skipped.append((ns, key))
                continue
            batch.append((ns, key, entry[1], entry[0], dram))
        if batch:
            self._post("read", batch)
        return skipped

    def remove(self, namespace: str, key: Key) -> bool:
        """Forget a disk copy (its slot is free once no read uses it)."""
        return self._index.remove((namespace, key))

    def poll(self) -> DiskCompletions:
        """Completed and failed I/O since the last call (non-blocking). A request in flight
        past ``request_timeout_s`` is given up (``_give_up``), its slots kept until it ends."""
        done, self._failed_at_start = self._failed_at_start, DiskCompletions()
        now = time.monotonic()
        left = []
        for request in self._requests:
            state = self._io.state(request.handle, request.kind, request.directory)
            if state != "PROC":
                self._finish(request, state == "DONE", done)
            elif now >= request.deadline:
                self._give_up(request, done)
            else:
                left.append(request)
        self._requests = left
        for request, ok in self._stuck.ended():
            self._unstick(request, ok, done)
        self._sync_journals(force=False)
        return done

    # -- lifecycle ----------------------------------------------------------------------------

    def recover(self) -> list[tuple[str, Key, int]]:
        """Rebuild the index from the journals, keeping the blocks that verify (module
        docstring). Returns ``(namespace, key, digest)`` of each, least recently used first
        (journal order: a compaction's records, in slot order, then those appended since). Call
        once, before any other I/O."""
        self._counters["disk_recover_dropped"] += self._index.recover(self.block_len)
        return [(ns, key, digest) for (ns, key), (_, digest) in self._index.where.items()]

    def stats(self) -> dict[str, Any]:
        c = self._counters
        return {
            **c,
            "disk_keys": len(self._index),
            "disk_stuck_in_flight": len(self._stuck),
            "disk_writes_failing": len(self._index.failing | self._stuck.dirs()),
            "disk_bytes": len(self._index) * self.block_len,
            "disk_capacity_bytes": self.capacity * self.block_len,
            **{
                f"disk_{kind}_gbps": c[f"disk_{kind}_bytes"] / busy / 1e9 if busy else 0.0
                for kind, busy in self._busy_s.items()
            },
            "disk_direct_io": self.direct_io,
        }

    def sync(self, timeout: float) -> bool:
        """Write and sync every journal record appended so far, waiting at most ``timeout``
        seconds; whether done, so that a restart finds no key removed before. False too where a
        journal dropped records and can be neither emptied nor removed (``DiskDir.unsafe``): a
        restart may then bring back a key removed since, until its rewrite (a failing device)."""
        deadline = time.monotonic() + timeout
        if not self._journals.wait(timeout):
            return False
        self._sync_journals(force=True)
        done = self._journals.wait(deadline - time.monotonic())
        return done and not any(d.unsafe for d in self._dirs)  # read while no batch runs

    def close(self) -> None:
        """Wait (at most ``CLOSE_WAIT_S``) for I/O in flight, sync the journals, release every
        NIXL handle and registration, close the files. Idempotent. A read failing meanwhile keeps
        its key (module docstring: its block intact; a restart verifies it). A request still in
        flight then (a hung device) may yet write the pool or read it, a journal sync still
        running may yet use the files: the NIXL agent, registrations and files, and
        ``pool_owner``, are then never released (logged), not even by interpreter shutdown."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + CLOSE_WAIT_S
        while (self._requests or self._stuck) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.001)
        left, self._requests = self._requests + self._stuck.take_all(), []
        synced = self.sync(max(1.0, deadline - time.monotonic()))
        if not self._journals.close(max(1.0, deadline - time.monotonic())) or left:
            logger.error(
                "disk: %d requests still in flight, journals %s, %.0f s after close (a hung "
                "device?): the pool, files and NIXL agent they use are kept, not freed, until "
                "this process exits; restart it once %s answer again", len(left),
                "synced" if synced else "not synced", CLOSE_WAIT_S,
                [str(d.path) for d in self._dirs],
            )  # fmt: skip
            # one reference more, never dropped: not even interpreter shutdown, which clears
            # module globals, frees them (as ``transport.agent_lifetime`` keeps its agents)
            kept = (self._io, self._dirs, self._pool_owner, left)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
            self._dirs = []
            return
        self._io.close()
        self._close_files()

    # -- internals ----------------------------------------------------------------------------

    def _post(self, kind: str, batch: list[tuple[str, Key, int, int, int]]) -> None:
        n = len(self._dirs)
        by_dir: dict[int, list[tuple[str, Key, int, int, int]]] = {}
        for item in batch:
            by_dir.setdefault(item[3] % n, []).append(item)
        for f, items in by_dir.items():
            for it in items:
                self._index.slots.start_io(it[3])
                self._busy_dram[it[4]] = self._busy_dram.get(it[4], 0) + 1
            request = Request(
                None, kind, items, len(items) * self.block_len, time.perf_counter(), f,
                time.monotonic() + self.request_timeout_s,
            )  # fmt: skip
            refused = f in self._stuck.dirs()  # a hung device: fail at once
            if refused:
                logger.debug("disk %s refused: %s has a request stuck", kind, self._dirs[f].path)
                state = "ERR"
            else:
                request.handle, state = self._io.post(
                    kind, f, [it[4] for it in items], [it[3] // n for it in items]
                )
            if state == "ERR":
                self._finish(request, False, self._failed_at_start, refused=refused)
            else:
                self._requests.append(request)

    def _finish(
        self, request: Request, ok: bool, done: DiskCompletions, *, refused: bool = False
    ) -> None:
        """A request ended (``ok``: done), or was ``refused`` (never posted: its directory has
        a request stuck). A read that failed drops its keys from the disk
        (``_drop_unreadable``); one refused, or failing at ``close``, keeps them: no byte of
        their blocks moved (a stuck request only reads its own slots, or writes a slot no key
        holds), so they are read once the directory answers again."""
        self._io.release(request.handle)
        self._busy_s[request.kind] += time.perf_counter() - request.started
        index = self._index
        for ns, key, digest, slot, dram in request.items:
            index.slots.end_io(slot)
            self._unbusy_dram(dram)
            pair = (ns, key)
            if request.kind == "write":
                self._writing.discard(pair)
                if ok:
                    index.put(pair, slot, digest)
                    done.written.append(pair)
                else:
                    index.slots.release(slot)
                    done.failed.append((ns, key, dram))
            elif ok and index.at(pair, slot):
                done.read.append((ns, key, dram, digest))
            else:  # failed, or its copy removed meanwhile (stored again: these bytes are old)
                if not refused:
                    self._drop_unreadable(pair, slot)
                done.failed.append((ns, key, dram))
        if request.kind == "write" and not (refused or self._closed):
            index.wrote(request.directory, ok, time.monotonic())
        if ok:
            self._counters[f"disk_{request.kind}s"] += len(request.items)
            self._counters[f"disk_{request.kind}_bytes"] += request.nbytes
        else:
            self._counters["disk_failures"] += len(request.items)

    def _give_up(self, request: Request, done: DiskCompletions) -> None:
        """A request past its deadline: its keys fail now, never a late hit. A write's key was
        never on disk and its DRAM slot (only read) is free; a read's DRAM slot is
        ``abandoned`` (its bytes may still land), its key kept (no ``DEL``: its block is
        intact). The disk slots stay taken, and the directory takes no write nor read until it
        ends (``_unstick``), then only probes until a write there is done (``DiskIndex.wrote``)."""
        self._stuck.add(request, self._dirs[request.directory].path, self.request_timeout_s)
        self._index.wrote(request.directory, False, time.monotonic())
        self._counters["disk_stuck"] += 1
        self._counters["disk_failures"] += len(request.items)
        for ns, key, _, _, dram in request.items:
            if request.kind == "write":
                self._writing.discard((ns, key))
                self._unbusy_dram(dram)
                done.failed.append((ns, key, dram))
            else:
                done.abandoned.append((ns, key, dram))

    def _unstick(self, request: Request, ok: bool, done: DiskCompletions) -> None:
        """A request given up has ended (``ok``: done; its bytes are ignored): its slots are
        free again. A read that failed drops its keys, as one failed in time does: a block whose
        read hangs the device, then fails, costs one hang, not one per read of it."""
        self._io.release(request.handle)
        for ns, key, _, slot, dram in request.items:
            self._index.slots.end_io(slot)
            if request.kind == "write":
                self._index.slots.release(slot)
                continue
            if not ok:
                self._drop_unreadable((ns, key), slot)
            self._unbusy_dram(dram)
            done.released.append(dram)

    def _drop_unreadable(self, pair: Pair, slot: int) -> None:
        """A read of ``pair``'s block in ``slot`` failed: the key leaves the disk (a ``DEL``),
        unless it was removed or stored again since, or the store is closing (its requests
        cancelled as the loop exits: the block is intact, a restart verifies it)."""
        if self._index.at(pair, slot) and not self._closed:
            self._index.remove(pair)

    def _unbusy_dram(self, dram: int) -> None:
        count = self._busy_dram.pop(dram) - 1
        if count:
            self._busy_dram[dram] = count

    def _sync_journals(self, *, force: bool) -> None:
        self._journals.hand_over(len(self._index), self._index.live_records, force=force)

    def _close_files(self) -> None:
        for d in self._dirs:
            quietly(d.close)
        self._dirs = []


__all__ = ["DiskCompletions", "DiskError", "DiskStore"]
