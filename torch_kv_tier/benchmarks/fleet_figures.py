"""The figures of ``torch-kv-tier fleet-bench`` (``fleet_bench``), each one measurement.

A simulated host (``SharedService`` over a ``SlotPool``), its sessions and followers, through
the real code and the real protocol frames; every function builds what it measures and lets it
go before it returns. Single-threaded, except ``fanout_us``'s drainer thread (joined, bounded
waits). Keys are 32 random bytes.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from torch_kv_tier.index import BlockIndex
from torch_kv_tier.keys import Key, Placement
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.leases import Session, SlotPool
from torch_kv_tier.remote.replica import IndexFollower
from torch_kv_tier.remote.shared_service import SharedService

PREFIX_KEYS = 64  # the keys of a prefix ``lookup_ns`` times


def _keys(n: int) -> list[bytes]:
    rnd = os.urandom(32 * n)
    return [rnd[i : i + 32] for i in range(0, 32 * n, 32)]


def _host(n_keys: int, sessions: int = 1, room: int = 0) -> tuple[SharedService, list[Session]]:
    """A host whose namespace ``"m"`` holds ``n_keys`` keys in a pool of ``n_keys + room``
    slots (0: full, as a host is once it has run a while), and ``sessions`` joined to it."""
    service = SharedService(SlotPool(max(n_keys + room, 1)), quota=None, max_granted=8192)
    members = [_session(f"s{i}") for i in range(sessions)]
    for session in members:
        service.join(session)
    _store(service, members[0], _keys(n_keys))
    return service, members


def _session(sid: str) -> Session:
    return Session(
        sid,
        sid,
        "fleet-bench",
        range(0),
        0.0,
        0.0,
        shared=True,
        namespace="m",
        identity=sid.encode(),
    )


def _store(service: SharedService, session: Session, keys: list[bytes]) -> None:
    for start in range(0, len(keys), 4096):
        batch = keys[start : start + 4096]
        slots = service.cache.grant(session.session_id, len(batch))
        service.cache.commit(session.session_id, batch, slots, [hash(k) & 0xFFFF for k in batch])


def _follow(service: SharedService, session: Session, index: BlockIndex) -> IndexFollower:
    """A follower of ``session``'s namespace feeding ``index``, its pages through the real
    frames; returns once joined."""
    peer = index.add_shared_peer("host", service.cache.pool.num_blocks)

    def on_change(stored, slots, digests, evicted, reset, sent) -> None:
        index.apply_host_changes(peer, stored, slots, digests, evicted, reset, sent)

    def request_page(
        cursor: int, done: Callable[[Future[p.ServerMessage]], None], on_sent: Callable[[], None]
    ) -> None:
        on_sent()
        answer = service.answer(session, p.SnapshotRequest(1, session.session_id, cursor), 0.0)
        future: Future[p.ServerMessage] = Future()
        future.set_result(p.decode_server(p.encode(answer)))  # type: ignore[arg-type]
        done(future)

    follower = IndexFollower(
        request_page, on_change, host="host", pool=service.cache.pool.num_blocks
    )
    follower.start()
    assert not follower.syncing
    return follower


def follower_bytes(n_keys: int, compact: bool = True) -> int:
    """Bytes ``tracemalloc`` sees a follower hold after it joined a host of ``n_keys`` keys
    (a compact copy, or a dict one), once the join's garbage is collected."""
    service, (session,) = _host(n_keys)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = BlockIndex(compact=compact)
        _follow(service, session, index)
        gc.collect()  # the snapshot's page futures and frames are garbage, not held
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.lookup([next(iter(service.cache.namespaces["m"].entries))]) == 1
    return held


def join_s(n_keys: int) -> float:
    """Seconds of a compact follower's join of a host of ``n_keys`` keys."""
    service, (session,) = _host(n_keys)
    index = BlockIndex(compact=True)
    start = time.perf_counter()
    _follow(service, session, index)
    return time.perf_counter() - start


def fanout_us(followers: int, batches: int) -> tuple[float, float]:
    """Host CPU per key per follower to push ``batches`` Events batches of newly stored keys to
    ``followers`` DEALER sockets; and the CPU one follower spends decoding and applying them."""
    service, members = _host(0, followers, room=batches * p.MAX_KEYS_PER_MESSAGE)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealers: list[zmq.Socket[bytes]] = []
    frames_in: list[bytes] = []
    drainer = threading.Thread(target=_drain, args=(dealers, batches, frames_in), daemon=True)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        router.setsockopt(zmq.SNDHWM, 0)
        for session in members:
            dealer = ctx.socket(zmq.DEALER)
            dealers.append(dealer)
            dealer.setsockopt(zmq.IDENTITY, session.identity)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(b"hello")  # a ROUTER drops frames for ids it has not heard from yet
        for _ in members:
            if not router.poll(10_000):
                raise TimeoutError("a follower socket did not connect within 10 s")
            router.recv_multipart()
        drainer.start()
        keys = _keys(batches * p.MAX_KEYS_PER_MESSAGE)
        host_cpu = 0.0
        for b in range(batches):
            batch = keys[b * p.MAX_KEYS_PER_MESSAGE : (b + 1) * p.MAX_KEYS_PER_MESSAGE]
            _store(service, members[0], batch)
            start = time.thread_time()
            for sessions, frame in service.events(members):  # as the server's _push_events
                for session in sessions:
                    router.send_multipart([session.identity, frame], zmq.NOBLOCK)
            host_cpu += time.thread_time() - start
        drainer.join(60)
        if drainer.is_alive() or len(frames_in) != batches:
            raise TimeoutError("the followers did not receive every Events frame within 60 s")
        index = BlockIndex(compact=True)
        peer = index.add_shared_peer("host", service.cache.pool.num_blocks)
        start = time.thread_time()
        for frame in frames_in:
            ev = p.decode_server(frame)
            assert isinstance(ev, p.Events)
            index.apply_host_changes(peer, ev.stored, ev.slots, ev.digests, ev.evicted, False)
        apply_cpu = time.thread_time() - start
    finally:
        if drainer.is_alive():
            drainer.join(5)
        for sock in (router, *dealers):
            sock.close(linger=0)
        ctx.term()
    n = batches * p.MAX_KEYS_PER_MESSAGE
    return host_cpu / (n * followers) * 1e6, apply_cpu / n * 1e6


def _drain(dealers: list[zmq.Socket[bytes]], batches: int, frames_in: list[bytes]) -> None:
    """A follower side of the fan-out: receive every frame (those of the first follower kept
    for the apply figure); gives up after 10 s without a frame."""
    want, got = batches * len(dealers), 0
    poller = zmq.Poller()
    for dealer in dealers:
        poller.register(dealer, zmq.POLLIN)
    while got < want and poller.poll(10_000):
        for dealer in dealers:
            while True:
                try:
                    frame = dealer.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got += 1
                if dealer is dealers[0]:
                    frames_in.append(frame)


def lookup_ns(n_keys: int, samples: int = 20_000) -> tuple[list[float], list[float]]:
    """Nanoseconds of ``holder`` of one key, and of ``lookup`` of a stored ``PREFIX_KEYS``-key
    prefix (``n_keys`` > ``PREFIX_KEYS``, or there is none)."""
    service, (session,) = _host(n_keys)
    index = BlockIndex(compact=True)
    _follow(service, session, index)
    keys = list(service.cache.namespaces["m"].entries)[:samples]
    clock, holder, lookup, ones, prefixes = time.perf_counter_ns, index.holder, index.lookup, [], []
    for key in keys:
        start = clock()
        holder(key)
        ones.append(float(clock() - start))
    for at in range(0, len(keys) - PREFIX_KEYS, PREFIX_KEYS):
        prefix = keys[at : at + PREFIX_KEYS]
        start = clock()
        lookup(prefix)
        prefixes.append(float(clock() - start))
    return ones, prefixes


def call_us(n_keys: int, compact: bool, calls: int = 2000) -> dict[str, float]:
    """Median µs of the index calls a 16-key shared store and load make, and of one-key
    ``contains``, on a copy of ``n_keys`` (>= 16) keys held as a dict or compact. Loads and
    ``contains`` ask stored keys, from the first again once ``calls`` outrun them."""
    keys: list[Key] = list(_keys(n_keys))
    index = BlockIndex(compact=compact)
    peer = index.add_shared_peer("host", n_keys + 16 * calls)
    for at in range(0, n_keys, p.MAX_KEYS_PER_MESSAGE):
        batch = keys[at : at + p.MAX_KEYS_PER_MESSAGE]
        index.apply_host_changes(
            peer, batch, list(range(at, at + len(batch))), [1] * len(batch), [], False
        )
    new: list[Key] = list(_keys(16 * calls))
    loads = n_keys // 16  # the distinct 16-key loads of stored keys
    calls_of = {
        "store_check_16": lambda i: index.none_stored(new[16 * i : 16 * i + 16]),
        "locate_16": lambda i: index.locate(
            keys[16 * (i % loads) : 16 * (i % loads + 1)], range(16)
        ),
        "publish_16": lambda i: index.publish(
            peer,
            new[16 * i : 16 * i + 16],
            list(range(n_keys + 16 * i, n_keys + 16 * (i + 1))),
            [1] * 16,
        ),
        "contains_1": lambda i: index.holder(keys[i % n_keys]),
    }
    out = {}
    for name, call in calls_of.items():
        times = []
        for i in range(calls):
            start = time.perf_counter_ns()
            call(i)
            times.append(time.perf_counter_ns() - start)
        out[name] = statistics.median(times) / 1e3
    return out


def moved_over_1_n(hosts: int, n_keys: int) -> list[float]:
    """The fraction of keys whose home changes over the ideal 1/N: one host added to ``hosts``
    (ideal 1/(N+1)), one of ``hosts`` removed (ideal 1/N)."""
    names = [f"10.0.{i // 250}.{i % 250}:5600" for i in range(hosts + 1)]
    keys = _keys(min(n_keys, 100_000))
    base = Placement(names[:hosts]).homes(keys)
    out = []
    for after in (names, names[1:hosts]):
        homes = Placement(after).homes(keys)
        moved = sum(a != b for a, b in zip(base, homes)) / len(keys)
        out.append(moved * max(hosts, len(after)))
    return out
