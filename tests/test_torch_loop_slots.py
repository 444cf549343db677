"""PagedKVOffloader's arena slots: frozen hosts hold at most their share, waits for slots and
restores end within their timeout, failed page copies and interrupted restores hand every slot
back."""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from remote_support import fake_session, wait_for
from torch_loop_support import (
    BLOCK_LEN,
    NUM_PAGES,
    PAGE,
    module_host,
    page,
    random_caches,
    restored_exactly,
    stored_pages,
    tcp_hosts,
)

from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.integrations.torch_loop import (
    OffloadError,
    PagedKVOffloader,
    arena_batches,
    prefix_keys,
)
from torch_kv_tier.integrations.torch_loop.host_shares import OVERDUE
from torch_kv_tier.keys import home_peer
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.results import TransferResult

remote = module_host()  # (the tests' ``remote`` host)


def test_a_restore_from_a_frozen_host_keeps_its_slots_until_its_read_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Over UCX's TCP transport a read from a stopped host stays on the wire: the restore gives
    # up after its timeout (0 pages, the cache untouched), but the read may still land in its
    # arena slots, so no later offload or restore may use them until the tier reported it.
    # Once the host resumes, the slots come back and the same restore is whole and exact.
    # Meanwhile calls that need those slots fail at once: before, each waited a whole timeout
    # for slots that could not come back (the loop stalled once per call while the host froze).
    monkeypatch.setenv("UCX_TLS", "tcp")
    keys_c, values_c = random_caches(torch.float32, seed=13)
    keys = prefix_keys(range(4 * PAGE), PAGE, namespace=b"frozen-restore")
    with (
        ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", env={"UCX_TLS": "tcp"}) as server,
        PagedKVOffloader.create(
            keys_c, values_c, remote=server.address, arena_blocks=4, timeout=3.0
        ) as off,
    ):
        assert off.offload(range(4), keys).result(timeout=30).ok
        expected, untouched = [page(keys_c, p) for p in range(4)], page(keys_c, 8)
        stop_process(server.proc.pid)
        try:
            assert off.restore(keys, [8, 9, 10, 11]) == 0
            assert torch.equal(page(keys_c, 8), untouched)
            assert off.manager.arena.num_free == 0  # the read may still land there
            started = time.monotonic()
            late = off.offload([4], [b"while-frozen"]).result(timeout=30)
            assert late.failed == {b"while-frozen": OVERDUE}
            assert off.restore(keys[:1], [12]) == 0
            assert time.monotonic() - started < 3.0  # neither waited its timeout (3 s)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: off.manager.arena.num_free == 4, 20.0)
        assert off.restore(keys, [8, 9, 10, 11]) == 4
        assert all(torch.equal(page(keys_c, 8 + i), expected[i]) for i in range(4))


def test_a_frozen_host_holds_at_most_half_the_arena_and_the_healthy_host_keeps_working(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two hosts, one frozen past every timeout: its reads stay on the wire (UCX over TCP) and
    # keep their arena slots until it resumes. A restore from it held a whole batch (here the
    # whole arena) and every later offload and restore failed with "capacity", the healthy
    # host's too, for as long as the host stayed frozen. Now one host's reads take at most half
    # the arena, and a restore stops before a key of a host whose reads are overdue.
    keys = [f"two-hosts-{i}".encode() for i in range(NUM_PAGES)]
    with tcp_hosts(monkeypatch, 2, seed=14) as (off, (_, frozen), (healthy_id, frozen_id)):
        assert off.offload(range(NUM_PAGES), keys).result(timeout=30).ok
        stored = stored_pages(off, keys)
        holders = off.manager.holders(keys)
        on_frozen = [k for k, h in zip(keys, holders) if h == frozen_id]
        on_healthy = [k for k, h in zip(keys, holders) if h == healthy_id]
        assert len(on_frozen) >= 4 and len(on_healthy) >= 2
        stop_process(frozen.proc.pid)
        try:
            assert off.restore(on_frozen[:4], [20, 21, 22, 23]) == 0
            assert off.manager.arena.num_free == 2  # the frozen host's read holds half
            mixed = [*on_healthy[:2], on_frozen[0]]  # stops before the overdue host, no slot
            assert off.restore(mixed, [20, 21, 22]) == 2
            assert restored_exactly(off, stored, mixed[:2], [20, 21])
            assert off.manager.arena.num_free == 2
            # Once its session is lost, every page goes to the healthy host, through 2 slots.
            assert wait_for(lambda: off.manager.peers() == [healthy_id], 30.0)
            fresh = [f"while-frozen-{i}".encode() for i in range(6)]
            stored.update(stored_pages(off, fresh))
            assert off.offload(range(6), fresh).result(timeout=30).ok
            assert off.restore(fresh, [12, 13, 14, 15, 16, 17]) == 6
            assert restored_exactly(off, stored, fresh, [12, 13, 14, 15, 16, 17])
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: off.manager.arena.num_free == 4, 20.0)  # no slot leaked
        assert wait_for(lambda: len(off.manager.peers()) == 2, 30.0)  # it joined again
        again = [f"after-thaw-{i}".encode() for i in range(16)]
        stored.update(stored_pages(off, again))
        assert off.offload(range(16), again).result(timeout=30).ok
        assert frozen_id in off.manager.holders(again)  # its reads are no longer overdue:
        assert off.restore(again, list(range(8, 24))) == 16
        assert restored_exactly(off, stored, again, list(range(8, 24)))
        assert off.manager.arena.num_free == 4


@pytest.mark.parametrize("first", ["restore", "offload"])
def test_two_frozen_hosts_leave_the_healthy_host_arena_slots(
    monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    # Each frozen host's reads held half the whole arena: two frozen hosts held all of it, and
    # the healthy host's restores and offloads failed ("capacity") while they stayed frozen.
    # Now a host's batch takes at most half the slots that overdue hosts and other hosts'
    # stores under way leave: the first frozen host holds 2 of 4 slots (a restore's that timed
    # out, or an offload's waiting for the host), the second 1, and the healthy host works.
    keys = [f"three-hosts-{i}".encode() for i in range(NUM_PAGES)]
    with tcp_hosts(monkeypatch, 3, seed=15) as (off, hosts, ids):
        assert off.offload(range(NUM_PAGES), keys).result(timeout=30).ok
        stored = stored_pages(off, keys)
        holders = off.manager.holders(keys)
        on = [[k for k, h in zip(keys, holders) if h == peer] for peer in ids]
        assert all(len(held) >= 2 for held in on)
        fresh = [f"three-hosts-fresh-{i}".encode() for i in range(64)]
        to = [[k for k in fresh if home_peer(k, ids) == peer] for peer in ids]
        for host in hosts[1:]:
            stop_process(host.proc.pid)
        try:
            if first == "restore":
                assert off.restore(on[1][:2], [20, 21]) == 0
            else:
                assert not off.offload([20, 21], to[1][:2]).done()
            assert off.restore(on[2][:2], [22, 23]) == 0
            assert off.manager.arena.num_free == 1  # 2 held by the first, 1 by the second
            assert off.restore(on[0][:2], [20, 21]) == 2  # in two batches of one slot
            assert restored_exactly(off, stored, on[0][:2], [20, 21])
            assert off.offload([6], to[0][:1]).result(timeout=30).ok
        finally:
            for host in hosts[1:]:
                os.kill(host.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: off.manager.arena.num_free == 4, 20.0)  # no slot leaked


def test_offloads_to_a_frozen_host_leave_the_healthy_hosts_arena_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A store to a frozen host waits for its grant until its session is lost (10 s), and so
    # did the arena slots of its whole batch, the healthy host's pages too: for those 10 s
    # every offload and restore waited a whole timeout for slots, then failed ("capacity").
    # Now a batch stores to each host separately, the stores under way to one host hold at
    # most half the arena, and the keys of a host whose stores are past their timeout fail at
    # once ("host overdue"). An offload of more than half the arena to the frozen host waits
    # (here once) for the host's share until that timeout: its page then fails "capacity"
    # (its own store, begun just after the offload, turns overdue only after that deadline).
    with tcp_hosts(monkeypatch, 2, seed=17) as (off, (_, frozen), (healthy_id, frozen_id)):
        peers = off.manager.peers()
        keys = [f"store-while-frozen-{i}".encode() for i in range(64)]
        to_healthy = [k for k in keys if home_peer(k, peers) == healthy_id]
        to_frozen = [k for k in keys if home_peer(k, peers) == frozen_id]
        stored = stored_pages(off, to_healthy[:4])
        assert off.offload(range(4), to_healthy[:4]).result(timeout=30).ok
        stop_process(frozen.proc.pid)
        try:
            mixed = [to_frozen[0], to_frozen[1], to_healthy[4], to_frozen[2]]
            stuck = off.offload(range(4, 8), mixed)  # the third for the frozen host waits
            assert wait_for(lambda: off.manager.arena.num_free == 2, 10.0)  # 2 frozen host's
            assert off.offload(range(8, 10), to_healthy[5:7]).result(timeout=30).ok
            assert off.restore(to_healthy[:4], [20, 21, 22, 23]) == 4
            assert restored_exactly(off, stored, to_healthy[:4], [20, 21, 22, 23])
            late = off.offload([10, 11], [to_frozen[3], to_healthy[7]]).result(timeout=30)
            assert late.keys == [to_healthy[7]] and late.failed == {to_frozen[3]: OVERDUE}
            assert off.manager.arena.num_free == 2 and not stuck.done()
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        done = stuck.result(timeout=30)
        assert to_healthy[4] in done.keys and done.failed.get(to_frozen[2]) == "capacity"
        assert wait_for(lambda: off.manager.arena.num_free == 4, 20.0)  # no slot leaked


def test_a_restore_counts_the_keys_on_a_hosts_disk_as_that_hosts(tmp_path: Path) -> None:
    # A key a host holds on its disk only is promoted there and read from it, but the tier
    # named no holder for it: a restore's per-host cap and its overdue hosts counted all disk
    # keys, of every host, as one host's (a frozen host's could take a second share of the
    # arena; its overdue reads stopped the restore at every other host's disk keys).
    keys_c, values_c = random_caches(torch.float32, seed=16)
    keys = [f"on-disk-{i}".encode() for i in range(NUM_PAGES)]
    disk = ["--disk", str(tmp_path), "--disk-bytes", str(64 * BLOCK_LEN), "--disk-admit", "1"]
    with (
        ServerProcess.start(8, BLOCK_LEN, host="127.0.0.1", extra_args=disk) as server,
        PagedKVOffloader.create(
            keys_c, values_c, remote=server.address, arena_blocks=8, timeout=10.0
        ) as off,
    ):
        assert wait_for(lambda: len(off.manager.peers()) == 1, 30.0)
        for i in range(0, NUM_PAGES, 8):  # each batch copied to disk before the next evicts it
            assert off.offload(range(i, i + 8), keys[i : i + 8]).result(timeout=30).ok
            with fake_session(server.address, block_len=BLOCK_LEN, private=False) as session:
                assert wait_for(lambda: session.stats()["disk_copies"] >= i + 8, 10.0)  # noqa: B023
        assert off.lookup(keys) == NUM_PAGES
        assert not all(map(off.manager.contains, keys))  # some are on its disk only
        assert off.manager.holders(keys) == off.manager.peers() * NUM_PAGES
        assert off.restore(keys[:8], list(range(16, 24))) == 8
        assert all(torch.equal(page(keys_c, 16 + i), page(keys_c, i)) for i in range(8))


def test_offload_waits_for_arena_slots_at_most_timeout_in_all() -> None:
    # A frozen host grants no slots: a store waits (holding its arena slot) until the session is
    # lost (10 s). An offload of many batches then fails the rest once its one timeout ran out.
    # (Its store turning overdue ends the wait too, so this cannot tell one deadline per offload
    # from one per batch: the slow-host test in test_arena_batches.py guards that.)
    keys_c, values_c = random_caches(torch.float32, seed=5)
    keys = [f"frozen-{i}".encode() for i in range(20)]
    with (
        ServerProcess.start(4, BLOCK_LEN, host="127.0.0.1") as server,
        PagedKVOffloader.create(
            keys_c, values_c, remote=server.address, arena_blocks=1, timeout=1.0
        ) as off,
    ):
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            future = off.offload(range(20), keys)
            took = time.monotonic() - started
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert took < 2.5
        result = future.result(timeout=30)
        assert not result.ok and "capacity" in result.failed.values()


def test_flush_returns_once_the_offload_futures_are_done() -> None:
    # An offload's future resolves after its batches' slots were handed back; in between, the
    # failed offload's warning goes to the log (here a slow handler). flush() woke on the slots
    # and returned True while the future was still pending.
    class SlowHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            time.sleep(0.5)

    keys_c, values_c = random_caches(torch.float32, seed=10)
    results_log = logging.getLogger("torch_kv_tier.integrations.torch_loop.offload_results")
    handler = SlowHandler()
    results_log.addHandler(handler)
    try:
        with (
            ServerProcess.start(4, BLOCK_LEN, host="127.0.0.1") as server,
            PagedKVOffloader.create(keys_c, values_c, remote=server.address, timeout=5) as off,
        ):
            os.kill(server.proc.pid, signal.SIGSTOP)  # its stores wait for slots it grants
            future = off.offload(range(8), [f"flush-{i}".encode() for i in range(8)])
            # Its stores are in flight: cancel() refuses (it said True, and the offload's end
            # logged InvalidStateError from the callback setting the cancelled future's result).
            assert not future.cancel()
            os.kill(server.proc.pid, signal.SIGKILL)  # then fail, "peer lost", off this thread
            assert off.flush(timeout=15)
            assert future.done()
            assert not future.result().ok
    finally:
        results_log.removeHandler(handler)


@pytest.mark.parametrize("timeout", [0.5, None])
def test_close_passes_what_is_left_of_its_timeout_to_the_tier(
    timeout: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: close(timeout) spent its timeout on the offloads, then closed its tier
    # with the tier's own default (10 s), which a frozen host's session end can take in full;
    # close(timeout=1) with a frozen host returned after about 3 s.
    keys_c, values_c = random_caches(torch.float32, seed=11)
    off = PagedKVOffloader.create(keys_c, values_c, timeout=2.0)
    real_close = off.manager.close
    given: list[float] = []

    def close(timeout: float = 10.0) -> None:
        given.append(timeout)
        real_close(timeout)

    monkeypatch.setattr(off.manager, "close", close)
    off.close(timeout)
    assert len(given) == 1 and 0 <= given[0] <= (2.0 if timeout is None else timeout), given
    assert off.manager.closed


def test_failed_page_copy_hands_its_arena_slots_back(
    remote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gather allocates the packed pages on the caches' device first: on a full GPU it raises
    # OutOfMemoryError. Its slots used to stay allocated for good, so every later offload and
    # restore waited its timeout and failed ("capacity", 0 pages).
    keys_c, values_c = random_caches(torch.float32, seed=6)
    with PagedKVOffloader.create(keys_c, values_c, remote=remote, arena_blocks=2, timeout=2) as off:
        real_gather = off._pages.gather

        def out_of_memory(pages: list[int], slots: list[int]) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        monkeypatch.setattr(off._pages, "gather", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            off.offload([0, 1], [b"oom-0", b"oom-1"])
        assert off.manager.arena.num_free == 2
        monkeypatch.setattr(off._pages, "gather", real_gather)
        assert off.offload([0, 1], [b"oom-0", b"oom-1"]).result(timeout=30).ok
        assert off.restore([b"oom-0", b"oom-1"], [5, 6]) == 2


def failed_load(keys: list[bytes]) -> Future[TransferResult]:
    """A tier load's future that failed every one of ``keys``."""
    future: Future[TransferResult] = Future()
    failed = dict.fromkeys(keys, "peer lost")
    future.set_result(TransferResult(ok=False, keys=[], failed=failed, nbytes=0, seconds=0.0))
    return future


@pytest.mark.parametrize("strict", [True, False])
def test_a_restore_whose_page_copy_fails_says_how_many_pages_it_wrote(
    remote: str, strict: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: a restore in batches whose copy into the cache failed (out of memory for
    # the loaded pages on the GPU) raised that error alone: the pages of its earlier batches were
    # already written and the failing batch's partly, and nothing said which.
    keys_c, values_c = random_caches(torch.float32, seed=12)
    keys = [f"scatter-{strict}-{i}".encode() for i in range(4)]
    with PagedKVOffloader.create(
        keys_c, values_c, remote=remote, arena_blocks=2, strict=strict
    ) as off:
        assert off.offload(range(4), keys).result(timeout=30).ok
        real_scatter = off._pages.scatter
        calls: list[list[int]] = []

        def second_fails(slots: list[int], pages: list[int]) -> None:
            calls.append(pages)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            real_scatter(slots, pages)

        monkeypatch.setattr(off._pages, "scatter", second_fails)
        with pytest.raises(
            OffloadError, match=r"wrote 2 of 4 .*page_ids\[0:2\].*page_ids\[2:4\]"
        ) as err:
            off.restore(keys, [10, 11, 12, 13])
        assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
        assert off.manager.arena.num_free == 2  # the failing batch's slots came back
        if strict:  # a short restore says where its pages went too
            real_load = off.manager.load

            def second_batch_lost(
                batch: list[bytes], slots: list[int], begun: list[Any] | None = None
            ) -> Future[TransferResult]:
                return failed_load(batch) if keys[2] in batch else real_load(batch, slots, begun)

            monkeypatch.setattr(off.manager, "load", second_batch_lost)
            monkeypatch.setattr(off._pages, "scatter", real_scatter)
            with pytest.raises(OffloadError, match=r"only 2 of 4 .*page_ids\[0:2\]"):
                off.restore(keys, [10, 11, 12, 13])


def test_a_restore_interrupted_while_its_reads_are_under_way_leaks_no_arena_slot(
    remote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: Ctrl-C (KeyboardInterrupt) while a restore waited for its reads left its
    # arena slots allocated for good (no path handed them back), so in a notebook that went on
    # with the offloader every later offload and restore waited its timeout and failed. Now each
    # read keeps its slots until it ends (it may still land there), then they come back.
    keys_c, values_c = random_caches(torch.float32, seed=18)
    keys = [f"interrupted-{i}".encode() for i in range(2)]
    with PagedKVOffloader.create(keys_c, values_c, remote=remote, arena_blocks=3) as off:
        assert off.offload([0, 1], keys).result(timeout=30).ok
        read: Future[TransferResult] = Future()  # a read under way, ended below
        monkeypatch.setattr(off.manager, "load", lambda batch, slots, begun: read)

        def ctrl_c(*args: Any, **kwargs: Any) -> Any:
            raise KeyboardInterrupt

        monkeypatch.setattr(arena_batches, "wait", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            off.restore(keys, [10, 11])
        assert off.manager.arena.num_free == 1  # the read may still land in its 2 slots
        read.set_result(TransferResult(ok=True, keys=keys, failed={}, nbytes=0, seconds=0.0))
        assert off.manager.arena.num_free == 3
        monkeypatch.undo()
        assert off.restore(keys, [10, 11]) == 2
        assert torch.equal(page(keys_c, 10), page(keys_c, 0))
        assert off.manager.arena.num_free == 3


def test_a_restore_out_of_time_starts_no_read_it_cannot_wait_for(
    remote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: a restore in batches whose earlier batches used up its timeout still
    # started the next batch's reads and waited 0 s for them. Here (loopback) they finished
    # during their submission and the restore went on past its timeout; over a network they
    # were given up: their slots held as a timed-out read's, the healthy host logged "timed
    # out" and counted overdue, so the next restore stopped at its keys (0 pages) until those
    # reads ended. Now a restore out of time starts no read.
    keys_c, values_c = random_caches(torch.float32, seed=19)
    keys = [f"out-of-time-{i}".encode() for i in range(4)]
    with PagedKVOffloader.create(
        keys_c, values_c, remote=remote, arena_blocks=2, timeout=1.0
    ) as off:
        assert off.offload(range(4), keys).result(timeout=30).ok
        real_load, real_scatter = off.manager.load, off._pages.scatter
        loads: list[list[bytes]] = []

        def counted(
            batch: list[bytes], slots: list[int], begun: list[Any] | None = None
        ) -> Future[TransferResult]:
            loads.append(batch)
            return real_load(batch, slots, begun)

        def slow_copy(slots: list[int], pages: list[int]) -> None:
            time.sleep(1.2)  # past the restore's timeout
            real_scatter(slots, pages)

        monkeypatch.setattr(off.manager, "load", counted)
        monkeypatch.setattr(off._pages, "scatter", slow_copy)
        assert off.restore(keys, [10, 11, 12, 13]) == 2
        assert loads == [keys[:2]]  # no read started once the time was up
        assert off.manager.arena.num_free == 2
        monkeypatch.setattr(off._pages, "scatter", real_scatter)
        assert off.restore(keys[2:], [12, 13]) == 2
        assert torch.equal(page(keys_c, 13), page(keys_c, 3))
