"""PagedKVOffloader and its hosts: hosts down, stalled or lost at create or mid-generation join
(or are dropped) as they should, dials under way as an offloader closes leave a user's own tier
alone, a Ctrl-C in a callback of the tier's connect leaves the host usable."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from arena_support import CtrlCAsItsCallbacksRun, stored
from membership_support import join_wait_s, redial_quickly
from remote_support import SilentHosts, free_port, wait_for
from test_transfer_timeout import NeverDone
from torch_loop_support import (
    BLOCK_LEN,
    DIALLING_THREADS,
    PAGE,
    module_host,
    page,
    random_caches,
)

from torch_kv_tier import parallel_connects
from torch_kv_tier.integrations.torch_loop import (
    OffloadError,
    PagedKVOffloader,
    prefix_keys,
)
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.launch import ServerProcess

remote = module_host()  # (the tests' ``remote`` host)


def test_a_host_down_at_create_joins_once_it_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by review: a host that did not answer at create() was never dialled again (the tier
    # re-dials only hosts once connected), so every offload failed and every restore was 0 for
    # the offloader's life. Now the tier dials it until it joins (connect's redial_if_down), and
    # once joined dials it again when it restarts.
    redial_quickly(monkeypatch)
    keys_c, values_c = random_caches(torch.float32, seed=14)
    port = free_port()  # nobody listens here yet
    address = f"127.0.0.1:{port}"
    with PagedKVOffloader.create(
        keys_c, values_c, remote=address, timeout=5, connect_timeout=0.5, reconnect_interval_s=0.2
    ) as off:
        assert off.manager.peers() == []
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=["--port", str(port)]):
            assert wait_for(lambda: off.manager.peers() != [], join_wait_s())
            assert off.offload([0, 1], [b"late-0", b"late-1"]).result(timeout=30).ok
            assert off.restore([b"late-0", b"late-1"], [5, 6]) == 2
            assert torch.equal(page(keys_c, 5), page(keys_c, 0))
        assert wait_for(lambda: off.manager.peers() == [], 20.0)
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=["--port", str(port)]):
            assert wait_for(lambda: off.manager.peers() != [], join_wait_s())  # dialled again
    dialling = [t.name for t in threading.enumerate() if t.name.startswith(DIALLING_THREADS)]
    assert dialling == []  # close stopped the dialling
    with pytest.raises(ValueError, match="reconnect_interval_s"):
        PagedKVOffloader.create(keys_c, values_c, reconnect_interval_s=-1)


def test_a_host_stalled_past_transfer_timeout_s_is_dropped_while_a_restore_keeps_its_slots(
    remote: str,
) -> None:
    """A transfer NIXL never completes held its host until close. Past ``transfer_timeout_s``
    the host is dropped and dialled again, but a restore's read from it keeps its arena slots
    (the read may still land in them) until the transport reports it."""
    keys_c, values_c = random_caches(torch.float32, seed=21)
    keys = [b"stall-0", b"stall-1"]
    with PagedKVOffloader.create(
        keys_c,
        values_c,
        remote=remote,
        timeout=2,
        connect_timeout=10,
        reconnect_interval_s=0.2,
        transfer_timeout_s=0,  # started below, once the setup's offload is done
    ) as off:
        assert off.offload([0, 1], keys).result(timeout=30).ok
        tier = off.manager
        # the bound from now on (as tests/test_transfer_timeout.py's start_bound): a busy box
        # that slows the setup's offload past it cannot drop the host before the test begins
        tier._overdue.timeout_s = 1.0
        free = tier.arena.num_free
        agent = NeverDone(tier.transport._agent)  # type: ignore[attr-defined]
        tier.transport._agent = agent  # type: ignore[attr-defined]
        agent.stuck = True
        try:
            assert off.restore(keys, [5, 6]) == 0  # past the offloader's timeout
            assert wait_for(lambda: tier.stats().peers_dropped == 1, 20.0)
            assert tier.arena.num_free == free - 2 and tier.stats().late_reads == 0
        finally:
            agent.stuck = False  # the read is reported: its slots come back
        assert wait_for(lambda: tier.arena.num_free == free, 20.0)
        assert wait_for(lambda: off.manager.peers() != [], 20.0)  # dialled again


def test_hosts_down_at_create_past_the_connects_at_once_join_once_they_are_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: past MAX_CONNECTS hosts, create() greets them all first, and a host that
    # did not answer the greeting got a TimeoutError without a connect, so without connect's
    # redial_if_down: the offloader logged that the tier dials it until it joins, and nothing
    # ever dialled it.
    monkeypatch.setattr(parallel_connects, "MAX_CONNECTS", 1)  # 2 hosts: greeted first
    redial_quickly(monkeypatch)
    keys_c, values_c = random_caches(torch.float32, seed=16)
    ports = [free_port(), free_port()]  # nobody listens here yet
    remotes = [f"127.0.0.1:{port}" for port in ports]
    with PagedKVOffloader.create(
        keys_c, values_c, remote=remotes, timeout=5, connect_timeout=0.5
    ) as off:
        assert off.manager.peers() == []
        extra_args = ["--port", str(ports[1])]
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=extra_args):
            assert wait_for(lambda: off.manager.peers() == [remotes[1]], join_wait_s())
    dialling = [t.name for t in threading.enumerate() if t.name.startswith(DIALLING_THREADS)]
    assert dialling == []  # close stopped the dialling


def test_a_host_that_joined_late_and_was_disconnected_is_not_dialled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: a host down at create() was dialled by a membership thread for the
    # offloader's life, which connected it again within reconnect_interval_s of the user's
    # off.manager.disconnect (a host connected at create stays disconnected). Once it joined,
    # it is now the tier's to dial again when lost, as one connected at create is.
    redial_quickly(monkeypatch)
    keys_c, values_c = random_caches(torch.float32, seed=15)
    port = free_port()  # nobody listens here yet
    address = f"127.0.0.1:{port}"
    with (
        PagedKVOffloader.create(
            keys_c, values_c, remote=address, timeout=5, connect_timeout=0.5,
            reconnect_interval_s=0.1,
        ) as off,
        ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=["--port", str(port)]),
    ):  # fmt: skip
        assert wait_for(lambda: off.manager.peers() != [], join_wait_s())
        (peer,) = off.manager.peers()
        off.manager.disconnect(peer)
        time.sleep(1.0)  # ten dialling intervals
        assert off.manager.peers() == []
        assert off.restore([b"gone-0"], [3]) == 0


@contextlib.contextmanager
def _offloader_over_users_tier(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> Iterator[tuple[TierManager, PagedKVOffloader, int]]:
    """A user's tier (redials from 0.1 s, ``redial_quickly``), an offloader over it, and a port
    nobody listens on yet, for the host down at their connects."""
    redial_quickly(monkeypatch)
    keys_c, values_c = random_caches(torch.float32, seed=17)
    block_len = PagedKVOffloader.block_len_for(keys_c, values_c)
    with TierManager.create(8, block_len, name=name) as tier:
        yield (
            tier,
            PagedKVOffloader(keys_c, values_c, tier, timeout=5, reconnect_interval_s=0.1),
            free_port(),
        )


def test_a_dial_under_way_as_the_offloader_closes_leaves_the_users_tier_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: an offloader over the user's tier (not its own) stopped dialling a host
    # that was down at its connect at close, but a handshake under way then went on past the
    # close and joined the host into the user's tier for good. Now the tier dials it, and the
    # offloader's close cancels the dial: what the handshake connects is removed at once.
    with _offloader_over_users_tier(monkeypatch, "users-tier") as (tier, off, port):
        address = f"127.0.0.1:{port}"
        entered, go = threading.Event(), threading.Event()
        open_ = tier._open

        def held_open(*args: Any, **kwargs: Any) -> Any:
            session = open_(*args, **kwargs)
            if threading.current_thread() is not threading.main_thread():  # a dialler's
                entered.set()  # the host answered: its join waits
                go.wait(timeout=30)
            return session

        monkeypatch.setattr(tier, "_open", held_open)
        assert off.connect(address, connect_timeout=0.5) == ""
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=["--port", str(port)]):
            assert entered.wait(timeout=join_wait_s()), "the host was not dialled"
            off.close(timeout=0.5)
            go.set()
            time.sleep(1.0)  # ten times the first redial's delay
            assert tier.peers() == [], "the closed offloader's dial joined the host"


@pytest.mark.parametrize("users_first", [True, False], ids=["user-offloader", "offloader-user"])
def test_an_offloaders_close_leaves_the_users_own_dial_of_an_address(
    monkeypatch: pytest.MonkeyPatch, users_first: bool
) -> None:
    # Found by review: an offloader over the user's tier cancelled at close every address its
    # connects left to the tier's dialler (cancel_dial(address)), but the tier keeps one dial
    # per address: a host the user had connected with redial_if_down too (before the
    # offloader's connect, or after it) was no longer dialled, and never joined. The close
    # withdraws only the offloader's own request now.
    with _offloader_over_users_tier(monkeypatch, "users-own-dial") as (tier, off, port):
        address = f"127.0.0.1:{port}"
        connects = [
            lambda: pytest.raises(TimeoutError, tier.connect, address, timeout_s=0.5,
                                  redial_if_down=True),
            lambda: off.connect(address, connect_timeout=0.5),
        ]  # fmt: skip
        for connect in connects if users_first else connects[::-1]:
            connect()
        off.close(timeout=0.5)
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=["--port", str(port)]):
            assert wait_for(lambda: tier.peers() != [], join_wait_s()), (
                "the user's dial was cancelled"
            )


def test_a_host_lost_while_joining_at_create_joins_once_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: only a host that did not answer at all (TimeoutError) was dialled again;
    # one whose session was lost while joining (its control connection reset mid-snapshot, or it
    # died answering: ConnectionError "lost before it sent its index", seen with ss -K) was
    # never dialled again, and the offloader ran without it for its whole life.
    keys_c, values_c = random_caches(torch.float32, seed=16)
    real_connect = TierManager._connect
    failed: list[str] = []

    def lost_once(self: TierManager, dial: Any) -> str:
        if not failed:
            failed.append(dial.address)
            raise ConnectionError(f"{dial.address} was lost before it sent its index")
        return real_connect(self, dial)

    monkeypatch.setattr(TierManager, "_connect", lost_once)
    with (
        ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1") as server,
        PagedKVOffloader.create(
            keys_c, values_c, remote=server.address, timeout=5, reconnect_interval_s=0.1
        ) as off,
    ):
        assert failed == [server.address]
        assert wait_for(lambda: off.manager.peers() != [], 20.0)
        assert off.offload([0], [b"rejoined"]).result(timeout=30).ok


def test_hosts_that_do_not_answer_at_create_are_dialled_side_by_side() -> None:
    # Found by review: create() connected its hosts one after another, so N hosts that do not
    # answer held it for N x connect_timeout (4 hosts down: 40 s at the default 10 s); they are
    # dialled side by side now. strict still raises for the first host listed that failed, and
    # no connect is left running after.
    keys_c, values_c = random_caches(torch.float32, seed=15)
    silent = SilentHosts(4)
    with contextlib.closing(silent), ThreadPoolExecutor(1) as pool:
        kwargs: dict[str, Any] = dict(remote=silent.addresses, reconnect_interval_s=0)
        created = pool.submit(
            PagedKVOffloader.create, keys_c, values_c, connect_timeout=5, **kwargs
        )
        dialled = silent.dialled_side_by_side(within=4.0)
        with created.result(timeout=60) as off:
            assert off.manager.peers() == []
        assert dialled, "each host was dialled only once the one before it gave up"
        last = silent.addresses[-1]
        with pytest.raises(OffloadError, match=f"cannot connect to remote host {last}"):
            kwargs["remote"] = [last, *silent.addresses[:-1]]
            PagedKVOffloader.create(keys_c, values_c, connect_timeout=0.5, strict=True, **kwargs)
    assert not [t.name for t in threading.enumerate() if t.name.startswith(DIALLING_THREADS)]


def test_remote_dying_mid_generation_falls_back_without_raising() -> None:
    keys_c, values_c = random_caches(torch.float32, seed=4)
    keys = prefix_keys(range(4 * PAGE), PAGE, namespace=b"dies")
    with (
        ServerProcess.start(64, BLOCK_LEN, host="127.0.0.1") as server,
        PagedKVOffloader.create(keys_c, values_c, remote=server.address, timeout=10) as off,
    ):
        assert off.offload([0, 1, 2, 3], keys).result(timeout=30).ok
        expected = [page(keys_c, p) for p in range(4)]
        server.kill()
        started = time.monotonic()
        restored = off.restore(keys, [8, 9, 10, 11])  # partial or 0, but no exception
        assert 0 <= restored <= 4 and time.monotonic() - started < 15
        for i in range(restored):  # whatever did come back is right
            assert torch.equal(page(keys_c, 8 + i), expected[i])
        late = off.offload([4], [b"after-death"]).result(timeout=30)  # does not raise either
        assert late.keys == [] or late.ok


def test_a_ctrl_c_in_a_callback_the_tiers_connect_ran_leaves_the_host_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: the tier's connect resolves, on the caller's thread, the futures of
    # stores that ended meanwhile (``_flush``, as a connect drops a registration it replaces or
    # a join it gave up). A Ctrl-C stopping a store's callbacks there left its record: its
    # host "overdue" (its pages failing at once) and its slot out of the arena until a flush.
    # A Ctrl-C out of connect now makes the next look at the state look at every record.
    keys_c, values_c = random_caches(torch.float32)
    with TierManager.create(4, BLOCK_LEN) as manager:
        off = PagedKVOffloader(keys_c, values_c, manager, timeout=5)
        store = CtrlCAsItsCallbacksRun()
        off._batches._started(store, "frozen", manager.arena.allocate(1), time.monotonic())

        def connect(address: str, **kwargs: object) -> str:
            store.set_result(stored([]))
            return "never"

        monkeypatch.setattr(manager, "connect", connect)
        with pytest.raises(KeyboardInterrupt):
            off.connect("127.0.0.1:1")
        assert not off._batches._overdue()  # before: {"frozen": 1}, until a flush
        assert manager.arena.num_free == 4  # before: 3
