"""The custom-PyTorch-loop integration: prefix keys, paged-KV decoder, PagedKVOffloader.

Tier tests run against a real ``torch-kv-tier serve`` subprocess on loopback (one per module).
CUDA tests skip cleanly without a GPU.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from arena_support import CtrlCAsItsCallbacksRun, stored
from remote_support import SilentHosts, fake_session, free_port, wait_for
from test_transfer_timeout import NeverDone

from torch_kv_tier import connections, parallel_connects
from torch_kv_tier.benchmarks.reliability_common import stop_process
from torch_kv_tier.connections import REDIAL_THREAD
from torch_kv_tier.integrations.torch_loop import (
    OffloadError,
    PagedKVOffloader,
    Staging,
    arena_batches,
    prefix_keys,
)
from torch_kv_tier.integrations.torch_loop import keys as keys_module
from torch_kv_tier.integrations.torch_loop.example import main as example_main
from torch_kv_tier.integrations.torch_loop.example import run_demo
from torch_kv_tier.integrations.torch_loop.host_shares import OVERDUE
from torch_kv_tier.integrations.torch_loop.model import DecoderConfig, PagedKVCache, TinyDecoder
from torch_kv_tier.keys import home_peer
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.results import TransferResult

PAGE = 8
CONFIG = DecoderConfig(vocab_size=128, hidden=64, layers=2, heads=2, ffn=128, max_positions=512)
# Every cache below is [NUM_PAGES, PAGE, HEADS, HEAD_BYTES // itemsize] x LAYERS, so one page
# across all layers is always BLOCK_LEN bytes and one server serves every dtype.
LAYERS, HEADS, HEAD_BYTES, NUM_PAGES = 2, 2, 128, 24
BLOCK_LEN = LAYERS * 2 * PAGE * HEADS * HEAD_BYTES
assert CONFIG.layers * 2 * PAGE * CONFIG.hidden * 4 == BLOCK_LEN  # the float32 decoder's pages

DIALLING_THREADS = (REDIAL_THREAD, "tkvt-connect")  # the tier's redialer, a connect's

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    with ServerProcess.start(1024, BLOCK_LEN, host="127.0.0.1") as server:
        yield str(server.address)


def random_caches(
    dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    head_dim = HEAD_BYTES // torch.empty(0, dtype=dtype).element_size()
    shape = (NUM_PAGES, PAGE, HEADS, head_dim)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def page(caches: list[torch.Tensor], page_id: int) -> torch.Tensor:
    return torch.stack([c[page_id] for c in caches]).cpu()


# -- prefix keys ------------------------------------------------------------------------------


def test_prefix_keys_are_chained_per_full_page() -> None:
    tokens = list(range(100, 140))  # 5 full pages of 8
    keys = prefix_keys(tokens, PAGE)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert prefix_keys(tokens + [1, 2, 3], PAGE) == keys  # a partial page adds no key
    assert prefix_keys(tokens[:24], PAGE) == keys[:3]  # a prefix's keys are a prefix
    changed = tokens.copy()
    changed[17] += 1  # inside page 2: pages 0 and 1 keep their keys, every later key changes
    other = prefix_keys(changed, PAGE)
    assert other[:2] == keys[:2] and not set(other[2:]) & set(keys)
    assert not set(prefix_keys(tokens, PAGE, namespace=b"other model")) & set(keys)
    assert prefix_keys(torch.tensor(tokens), PAGE) == keys


def test_prefix_keys_are_stable_across_processes() -> None:
    # Load keys.py alone (no torch import): another interpreter, another hash() salt.
    code = (
        "import importlib.util as u, sys;"
        "s = u.spec_from_file_location('keys', sys.argv[1]); m = u.module_from_spec(s);"
        "s.loader.exec_module(m);"
        "print(' '.join(k.hex() for k in m.prefix_keys(range(40), 8, namespace=b'ns')))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, keys_module.__file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [k.hex() for k in prefix_keys(range(40), 8, namespace=b"ns")]


def test_prefix_keys_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="page_size"):
        prefix_keys([1, 2, 3], 0)
    for not_an_int in (8.0, "8", True):  # struct.error "bad char in struct format" for 8.0
        with pytest.raises(TypeError, match="page_size must be an int"):
            prefix_keys([1, 2, 3], not_an_int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="integers"):
        prefix_keys([1.5, 2.0], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="int64"):
        prefix_keys([2**63], 1)


# -- the decoder alone: restoring exact pages reproduces recompute bit for bit -----------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_restored_pages_give_identical_logits(dtype: torch.dtype) -> None:
    model = TinyDecoder(CONFIG, dtype=dtype)
    cache = PagedKVCache(CONFIG, 3 * 8, PAGE, dtype=dtype)
    prompt = torch.randint(0, CONFIG.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    first, second, third = (cache.allocate(8) for _ in range(3))
    tokens, reference = model.generate(prompt, first, cache, 6)
    restored = 4  # copy 4 computed pages into other pages, as a restore does, then compute on
    src, dst = torch.tensor(first[:restored]), torch.tensor(second[:restored])
    for layer in cache.keys + cache.values:
        layer.index_copy_(0, dst, layer.index_select(0, src))
    tokens2, logits = model.generate(prompt, second, cache, 6, start=restored * PAGE)
    assert torch.equal(logits, reference) and tokens2 == tokens
    # The check can fail: a single flipped value in a restored page changes the logits.
    for layer in cache.keys + cache.values:
        layer.index_copy_(0, torch.tensor(third[:restored]), layer.index_select(0, src))
    cache.keys[1][third[2], 3, 0, 0] += 1
    _, corrupted = model.generate(prompt, third, cache, 6, start=restored * PAGE)
    assert not torch.equal(corrupted, reference)


# -- the offloader against a real remote host -------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_offload_restore_round_trip_through_few_arena_slots(
    remote: str, dtype: torch.dtype
) -> None:
    keys_c, values_c = random_caches(dtype)
    src = [5, 0, 17, 3, 9, 11, 2, 20, 8, 13]
    keys = [f"rt-{dtype}-{i}".encode() for i in range(len(src))]
    # 3 arena slots for 10 pages: offload and restore go in batches and reuse slots.
    with PagedKVOffloader.create(keys_c, values_c, remote=remote, arena_blocks=3) as off:
        result = off.offload(src, keys).result(timeout=30)
        assert result.ok and result.keys == keys and result.nbytes == len(keys) * BLOCK_LEN
        expected_k = [page(keys_c, p) for p in src]
        expected_v = [page(values_c, p) for p in src]
        for cache in keys_c + values_c:
            cache.zero_()  # the tier holds the only copy now
        dst = [1, 4, 6, 7, 10, 12, 14, 15, 16, 18]
        assert off.restore(keys, dst) == len(keys)
        for i, p in enumerate(dst):
            assert torch.equal(page(keys_c, p), expected_k[i])
            assert torch.equal(page(values_c, p), expected_v[i])
        assert off.manager.arena.num_free == 3  # every slot handed back
        # Storing again sends nothing new but still reports every key stored.
        again = off.offload(src[:2], keys[:2]).result(timeout=30)
        assert again.ok and again.keys == keys[:2] and again.nbytes == 0


def test_restore_brings_back_only_the_stored_prefix(remote: str) -> None:
    keys_c, values_c = random_caches(torch.float32, seed=2)
    keys = prefix_keys(range(6 * PAGE), PAGE, namespace=b"partial")
    with PagedKVOffloader.create(keys_c, values_c, remote=remote) as off:
        # Pages 0, 1, 2 and 4 stored: the prefix stops at the gap.
        off.offload([0, 1, 2, 4], [keys[0], keys[1], keys[2], keys[4]]).result(timeout=30)
        before = [page(keys_c, p) for p in range(NUM_PAGES)]
        dst = [10, 11, 12, 13, 14, 15]
        assert off.lookup(keys) == 3
        assert off.restore(keys, dst) == 3
        for i, p in enumerate(dst):
            expected = before[i] if i < 3 else before[p]  # pages past the prefix untouched
            assert torch.equal(page(keys_c, p), expected)
        assert off.restore(keys[3:], dst[3:]) == 0  # a miss at the first key restores nothing


def test_caches_of_another_dtype_or_layout_never_restore_each_others_pages(remote: str) -> None:
    # float16 and bfloat16 caches of one shape have one block_len, so one host serves both; with
    # the default namespace the same tokens give the same keys. The bfloat16 offloader restored
    # the float16 pages' bits as bfloat16 values (every restored value wrong, no error).
    half_k, half_v = random_caches(torch.float16, seed=8)
    bf16_k, bf16_v = random_caches(torch.bfloat16, seed=9)
    # float16 again, twice the layers of half the page size: the same block_len, other meaning
    deep_k, deep_v = (
        [torch.randn(NUM_PAGES, PAGE // 2, HEADS, 64).half() for _ in range(2 * LAYERS)]
        for _ in range(2)
    )
    keys = prefix_keys(range(2 * PAGE), PAGE)
    with PagedKVOffloader.create(half_k, half_v, remote=remote) as half:
        assert half.offload([0, 1], keys).result(timeout=30).ok
        assert half.restore(keys, [5, 6]) == 2
    for other_k, other_v in ((bf16_k, bf16_v), (deep_k, deep_v)):
        with PagedKVOffloader.create(other_k, other_v, remote=remote) as other:
            assert other.lookup(keys) == 0
            assert other.restore(keys, [5, 6]) == 0


def test_restore_feeds_the_decoder_bit_identical_logits(remote: str) -> None:
    result = run_demo(
        remote,
        config=CONFIG,
        page_size=PAGE,
        prefix_tokens=40,
        suffix_tokens=5,
        new_tokens=4,
        repeat=1,
    )
    assert result.prefix_pages == 5 and result.pages_restored == 5
    assert result.restored_bytes == 5 * BLOCK_LEN
    assert result.logits_identical


def test_missing_remote_falls_back_to_recompute(remote: str) -> None:
    keys_c, values_c = random_caches(torch.float32, seed=3)
    address = f"127.0.0.1:{free_port()}"  # nobody listens here
    keys = [b"gone-0", b"gone-1"]
    before = page(keys_c, 5)
    with PagedKVOffloader.create(keys_c, values_c, remote=address, timeout=5) as off:
        assert off.manager.peers() == []
        result = off.offload([0, 1], keys).result(timeout=30)
        assert not result.ok and set(result.failed) == set(keys) and result.keys == []
        assert off.restore(keys, [5, 6]) == 0
    assert torch.equal(page(keys_c, 5), before)
    # strict=True turns each failure into OffloadError instead.
    with (
        PagedKVOffloader.create(keys_c, values_c, strict=True) as off,
        pytest.raises(OffloadError, match="no peers"),
    ):
        off.offload([0, 1], keys).result(timeout=30)
    half_k, half_v = [k[:, :4] for k in keys_c], [v[:, :4] for v in values_c]  # other block_len
    with pytest.raises(OffloadError, match=remote):
        PagedKVOffloader.create(half_k, half_v, remote=remote, strict=True)


def test_a_host_down_at_create_joins_once_it_is_up() -> None:
    # Found by review: a host that did not answer at create() was never dialled again (the tier
    # re-dials only hosts once connected), so every offload failed and every restore was 0 for
    # the offloader's life. Now the tier dials it until it joins (connect's redial_if_down), and
    # once joined dials it again when it restarts.
    keys_c, values_c = random_caches(torch.float32, seed=14)
    port = free_port()  # nobody listens here yet
    address = f"127.0.0.1:{port}"
    with PagedKVOffloader.create(
        keys_c, values_c, remote=address, timeout=5, connect_timeout=0.5, reconnect_interval_s=0.2
    ) as off:
        assert off.manager.peers() == []
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=["--port", str(port)]):
            assert wait_for(lambda: off.manager.peers() != [], 20.0)
            assert off.offload([0, 1], [b"late-0", b"late-1"]).result(timeout=30).ok
            assert off.restore([b"late-0", b"late-1"], [5, 6]) == 2
            assert torch.equal(page(keys_c, 5), page(keys_c, 0))
        assert wait_for(lambda: off.manager.peers() == [], 20.0)
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=["--port", str(port)]):
            assert wait_for(lambda: off.manager.peers() != [], 30.0)  # the tier dials it again
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
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
    keys_c, values_c = random_caches(torch.float32, seed=16)
    ports = [free_port(), free_port()]  # nobody listens here yet
    remotes = [f"127.0.0.1:{port}" for port in ports]
    with PagedKVOffloader.create(
        keys_c, values_c, remote=remotes, timeout=5, connect_timeout=0.5
    ) as off:
        assert off.manager.peers() == []
        extra_args = ["--port", str(ports[1])]
        with ServerProcess.start(16, BLOCK_LEN, host="127.0.0.1", extra_args=extra_args):
            assert wait_for(lambda: off.manager.peers() == [remotes[1]], 20.0)
    dialling = [t.name for t in threading.enumerate() if t.name.startswith(DIALLING_THREADS)]
    assert dialling == []  # close stopped the dialling


def test_a_host_that_joined_late_and_was_disconnected_is_not_dialled_again() -> None:
    # Found by review: a host down at create() was dialled by a membership thread for the
    # offloader's life, which connected it again within reconnect_interval_s of the user's
    # off.manager.disconnect (a host connected at create stays disconnected). Once it joined,
    # it is now the tier's to dial again when lost, as one connected at create is.
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
        assert wait_for(lambda: off.manager.peers() != [], 20.0)
        (peer,) = off.manager.peers()
        off.manager.disconnect(peer)
        time.sleep(1.0)  # ten dialling intervals
        assert off.manager.peers() == []
        assert off.restore([b"gone-0"], [3]) == 0


@contextlib.contextmanager
def _offloader_over_users_tier(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> Iterator[tuple[TierManager, PagedKVOffloader, int]]:
    """A user's tier (redials from 0.1 s), an offloader over it, and a port nobody listens on
    yet, for the host down at their connects."""
    monkeypatch.setattr(connections, "REDIAL_FIRST_S", 0.1)
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
            assert entered.wait(timeout=30), "the host was not dialled"
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
            assert wait_for(lambda: tier.peers() != [], 20.0), "the user's dial was cancelled"


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


@contextlib.contextmanager
def tcp_hosts(
    monkeypatch: pytest.MonkeyPatch, count: int, seed: int
) -> Iterator[tuple[PagedKVOffloader, list[ServerProcess], list[str]]]:
    """``count`` hosts over UCX's TCP transport (a stopped host's reads stay on the wire) and an
    offloader (4 arena slots, 3 s timeout) joined to all: it, the hosts and their peer ids."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    keys_c, values_c = random_caches(torch.float32, seed=seed)
    with contextlib.ExitStack() as stack:
        hosts = [
            stack.enter_context(
                ServerProcess.start(64, BLOCK_LEN, host="127.0.0.1", env={"UCX_TLS": "tcp"})
            )
            for _ in range(count)
        ]
        off = stack.enter_context(
            PagedKVOffloader.create(
                keys_c, values_c, remote=hosts[0].address, arena_blocks=4, timeout=3.0
            )
        )
        # create's connect of it can fail (UCX "Connection refused" to an address the host
        # advertised: another process's test veth, gone since) and is then dialled again
        assert wait_for(lambda: len(off.manager.peers()) == 1, 30.0)
        ids = [*off.manager.peers(), *(off.connect(host.address) for host in hosts[1:])]
        assert all(ids)
        yield off, hosts, ids


def stored_pages(off: PagedKVOffloader, keys: list[bytes]) -> dict[bytes, list[torch.Tensor]]:
    """Each of ``keys`` with the key and value pages ``off`` offloads under it from pages 0.."""
    return {k: [page(off.key_caches, i), page(off.value_caches, i)] for i, k in enumerate(keys)}


def restored_exactly(
    off: PagedKVOffloader,
    stored: dict[bytes, list[torch.Tensor]],
    keys: list[bytes],
    dst: list[int],
) -> bool:
    """Whether pages ``dst`` of ``off``'s caches hold what was ``stored`` under ``keys``."""
    got = {k: [page(off.key_caches, p), page(off.value_caches, p)] for k, p in zip(keys, dst)}
    return all(all(map(torch.equal, got[k], stored[k])) for k in keys)


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

            def second_batch_lost(batch: list[bytes], slots: list[int]) -> Future[TransferResult]:
                return failed_load(batch) if keys[2] in batch else real_load(batch, slots)

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
        monkeypatch.setattr(off.manager, "load", lambda batch, slots: read)

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

        def counted(batch: list[bytes], slots: list[int]) -> Future[TransferResult]:
            loads.append(batch)
            return real_load(batch, slots)

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


@pytest.mark.parametrize("built_in_inference_mode", ["caches", "offloader"])
def test_offload_restore_work_outside_the_inference_mode_things_were_built_in(
    remote: str, built_in_inference_mode: str
) -> None:
    # A server often builds its KV cache (or everything) under torch.inference_mode(). Tensors
    # made there refuse in-place writes outside it: restore raised once the pages had come
    # back (caches), offload raised and kept its arena slots (offloader: the arena).
    with torch.inference_mode(built_in_inference_mode == "caches"):
        keys_c, values_c = random_caches(torch.float32, seed=7)
    with torch.inference_mode(built_in_inference_mode == "offloader"):
        off = PagedKVOffloader.create(keys_c, values_c, remote=remote, arena_blocks=3)
    keys = [f"inference-{built_in_inference_mode}-{i}".encode() for i in range(4)]
    with off:
        expected = [page(keys_c, p) for p in range(4)]
        assert off.offload(range(4), keys).result(timeout=30).ok
        assert off.restore(keys, [10, 11, 12, 13]) == 4
        for i in range(4):
            assert torch.equal(page(keys_c, 10 + i), expected[i])
        assert off.manager.arena.num_free == 3


def test_bad_arguments_raise_before_any_transfer(remote: str) -> None:
    keys_c, values_c = random_caches(torch.float32)
    with TierManager.create(4, BLOCK_LEN * 2) as manager, pytest.raises(ValueError, match="block_"):
        PagedKVOffloader(keys_c, values_c, manager)
    with pytest.raises(ValueError, match="share shape"):
        PagedKVOffloader.block_len_for(keys_c, [v[:, :4] for v in values_c])
    with pytest.raises(ValueError, match="staging"):
        PagedKVOffloader.create(keys_c, values_c, staging="gpu")  # type: ignore[arg-type]
    # Connection arguments no host could accept: logged as "remote host ... unavailable" before,
    # leaving an offloader without a tier that recomputed everything.
    for kwargs, match in (
        ({"remote": remote, "slots": 8}, "private=True"),
        ({"remote": remote, "private": True, "slots": 0}, "slots must be > 0"),
        ({"remote": "localhost"}, "HOST:PORT"),
        ({"remote": remote, "token": ""}, "token is empty"),
    ):
        with pytest.raises(ValueError, match=match):
            PagedKVOffloader.create(keys_c, values_c, **kwargs)  # type: ignore[arg-type]
    with PagedKVOffloader.create(keys_c, values_c, remote=remote) as off:
        with pytest.raises(ValueError, match="page ids"):
            off.offload([0, 1], [b"a"])
        with pytest.raises(ValueError, match="outside"):
            off.restore([b"a"], [NUM_PAGES])
        with pytest.raises(ValueError, match="distinct"):
            off.restore([b"a", b"b"], [3, 3])
        with pytest.raises(ValueError, match="twice"):
            off.offload([1, 2], [b"a", b"a"])
        with pytest.raises(TypeError, match="keys must be"):
            off.offload([1], [1.5])  # type: ignore[list-item]
        assert off.lookup([b"a"]) == 0
        # lookup checks its keys as restore does, instead of logging a "tier lookup failed"
        # and answering 0 (a miss) for a key the tier could never hold. (Found by review: these
        # checks sat after the raising call in a pytest.raises block, so they never ran.)
        with pytest.raises(TypeError, match="keys must be"):
            off.lookup([1.5])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="at most 64 bytes"):
            off.lookup([b"x" * 65])
        with pytest.raises(ValueError, match="timeout"):
            off.flush(float("nan"))
    # A refused close() timeout leaves the offloader open: close() again closes its tier (a
    # close() that raised used to have marked it closed first, so its tier was never closed).
    off = PagedKVOffloader.create(keys_c, values_c)
    with pytest.raises(ValueError, match="timeout"):
        off.close(timeout=float("inf"))
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        off.manager.load([b"a"], [0])
    # Found by review: lookup on a closed offloader answered 0 (a miss, with a "tier lookup
    # failed" warning), where offload and restore raise.
    with pytest.raises(RuntimeError, match="lookup on a closed PagedKVOffloader"):
        off.lookup([b"a"])
    # connect, likewise, logged "remote host ... unavailable" and answered "" (no peer).
    with pytest.raises(RuntimeError, match="connect on a closed PagedKVOffloader"):
        off.connect(remote)


def test_create_refuses_a_bad_timeout_before_it_builds_a_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # inf raised OverflowError from the first wait; nan made every wait spin until it ended.
    # Found by review: create() checked its timeout only in __init__, after it had allocated the
    # arena and started a NIXL agent (then closed them again).
    keys_c, values_c = random_caches(torch.float32)

    def built(*args: object, **kwargs: object) -> TierManager:
        raise AssertionError("a tier was built for a call refused anyway")

    monkeypatch.setattr(TierManager, "create", built)
    for bad_timeout in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="timeout"):
            PagedKVOffloader.create(keys_c, values_c, timeout=bad_timeout)


def test_create_builds_its_tier_for_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier ``create`` builds: ``arena_blocks`` blocks of one page of every layer, in host
    memory (``staging="host"``, or the caches' device, here the CPU), fingerprinted by the
    caches' layout unless ``config_fields`` are given, and whose load past
    ``transfer_timeout_s`` waits for its read (its arena slots go back to the batches)."""
    keys_c, values_c = random_caches(torch.float16)
    real = TierManager.create
    built: list[dict[str, Any]] = []

    def create(*args: Any, **kwargs: Any) -> TierManager:
        built.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        raise RuntimeError("not built")

    monkeypatch.setattr(TierManager, "create", create)
    for staging, fields in (("host", None), ("device", {"model": "m"})):
        with pytest.raises(RuntimeError, match="not built"):
            PagedKVOffloader.create(
                keys_c,
                values_c,
                staging=staging,  # type: ignore[arg-type]
                arena_blocks=8,
                name="built",
                config_fields=fields,
                transfer_timeout_s=5,
            )
    layout = {"dtype": "torch.float16", "layers": LAYERS, "page": [PAGE, HEADS, HEAD_BYTES // 2]}
    tier = {
        "num_blocks": 8,
        "block_len": BLOCK_LEN,
        "device": "cpu",
        "name": "built",
        "transfer_timeout_s": 5,
        "settle_late_loads": False,
    }
    assert built == [
        {**tier, "config_fields": {"kv_layout": layout}},
        {**tier, "config_fields": {"model": "m"}},
    ]


def test_a_connect_waits_at_most_the_offloaders_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by review: create(timeout=...) did not pass its timeout to the tier's connect, which
    # waited its own 10 s for a host that does not answer (create(timeout=1) took 10 s).
    keys_c, values_c = random_caches(torch.float32)
    given: list[float] = []

    def connect(self: TierManager, address: str, **kwargs: Any) -> str:
        given.append(kwargs["timeout_s"])
        raise TimeoutError(f"nothing answered at {address}")

    monkeypatch.setattr(TierManager, "connect", connect)
    address = f"127.0.0.1:{free_port()}"
    for kwargs in ({"timeout": 0.5}, {}, {"timeout": 2.0, "connect_timeout": 20.0}):
        kwargs["reconnect_interval_s"] = 0  # no dialling in the background: only these connects
        with PagedKVOffloader.create(keys_c, values_c, remote=address, **kwargs) as off:  # type: ignore[arg-type]
            assert off.connect(address, connect_timeout=0.25) == ""
    assert given == [0.5, 0.25, 10.0, 0.25, 20.0, 0.25]
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="connect_timeout"):
            PagedKVOffloader.create(keys_c, values_c, remote=address, connect_timeout=bad)
    assert len(given) == 6  # refused before it dialled


# -- CUDA: both arena placements (skipped without a GPU) ---------------------------------------


@cuda
@pytest.mark.parametrize("staging", ["device", "host"])
def test_cuda_offload_restore_round_trip(remote: str, staging: Staging) -> None:
    keys_c, values_c = random_caches(torch.bfloat16, device="cuda")
    keys = [f"cuda-{staging}-{i}".encode() for i in range(6)]
    with PagedKVOffloader.create(
        keys_c,
        values_c,
        remote=remote,
        staging=staging,
        arena_blocks=4,
    ) as off:
        assert off.manager.arena.device.type == ("cuda" if staging == "device" else "cpu")
        assert off.offload([0, 2, 4, 6, 8, 10], keys).result(timeout=30).ok
        expected = [page(keys_c, p) for p in (0, 2, 4, 6, 8, 10)]
        for cache in keys_c + values_c:
            cache.zero_()
        assert off.restore(keys, [1, 3, 5, 7, 9, 11]) == 6
        for want, p in zip(expected, [1, 3, 5, 7, 9, 11], strict=True):
            assert torch.equal(page(keys_c, p), want)


@cuda
@pytest.mark.parametrize("staging", ["device", "host"])
def test_cuda_restore_gives_identical_logits(remote: str, staging: Staging) -> None:
    result = run_demo(
        remote,
        config=CONFIG,
        page_size=PAGE,
        prefix_tokens=40,
        suffix_tokens=5,
        new_tokens=4,
        device="cuda",
        staging=staging,
        repeat=1,
    )
    assert result.pages_restored == 5 and result.logits_identical


def test_example_command_starts_its_own_remote_host(capsys: pytest.CaptureFixture[str]) -> None:
    small = "--layers 2 --hidden 64 --page-size 8 --prefix-tokens 32 --suffix-tokens 4"
    assert example_main([*small.split(), "--new-tokens", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefix hit: 4/4 pages restored" in out
    assert "bit-identical to full recompute (torch.equal, prompt + decode): yes" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefix-tokens", "4"], "need prefix_tokens >= page_size"),
        (["--remote", "localhost"], "HOST:PORT"),
        (["--token-file", "/nonexistent/token"], "/nonexistent/token"),
    ],
)
def test_example_reports_bad_arguments_as_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by review: each raised a traceback (ValueError, FileNotFoundError) instead of
    # saying what is wrong.
    assert example_main(["--layers", "2", "--hidden", "64", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_example_refuses_a_cuda_device_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        example_main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available: run with --device cpu" in capsys.readouterr().err


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
