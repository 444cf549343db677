"""RemoteHostTier's configuration and startup inside vLLM: bad settings refused before anything
connects, the startup sizing, hosts down, silent or full at startup, and the default namespace
that separates models and layouts. Built and driven as vLLM does
(``vllm_tier_support``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import weakref
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec",
    reason="vLLM 0.33.0 is not installed (see requirements/vllm-0.33-cpu.txt)",
)

from remote_support import (  # noqa: E402
    SilentHosts,
    fake_session,
    free_port,
    wait_until,
)
from vllm_tier_support import (  # noqa: E402
    CHUNK_BYTES,
    REMOTE_BLOCKS,
    TIER_SLOTS,
    Driver,
    driven_manager,
    keys_for,
    make_manager,
)

from torch_kv_tier.integrations.vllm import tier_sizing  # noqa: E402
from torch_kv_tier.integrations.vllm.tier_config import RemoteHostTierConfig  # noqa: E402
from torch_kv_tier.integrations.vllm.tier_jobs import TierJobs  # noqa: E402
from torch_kv_tier.remote.launch import ServerProcess  # noqa: E402


def test_bad_config_raises_before_connecting() -> None:
    with pytest.raises(ValueError, match='"remote"'):
        make_manager("not-an-address")
    with pytest.raises(ValueError, match='"remote": bad host source .* accepted'):
        make_manager("dns:kv-hosts")  # no port
    with pytest.raises(ValueError, match='"slots"'):
        make_manager("127.0.0.1:1", slots=0)


def test_num_threads_defaults_to_none_and_refuses_below_0() -> None:
    """NIXL's worker threads only split transfers, which the tier never lets them do: none by
    default (``NixlTransport``), 0 accepted, a negative count or a non-integer refused."""
    config = RemoteHostTierConfig.from_options
    assert config({"remote": "127.0.0.1:1"}).num_threads == 0
    assert config({"remote": "127.0.0.1:1", "num_threads": 4}).num_threads == 4
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match='"num_threads" must be an integer >= 0'):
            config({"remote": "127.0.0.1:1", "num_threads": bad})


@pytest.mark.parametrize(
    "key",
    [
        "drain_timeout_s",
        "transfer_timeout_s",
        "close_timeout_s",
        "connect_timeout_s",
        "reconnect_interval_s",
        "promotion_guard_s",
    ],
)
def test_a_timeout_that_is_not_finite_is_refused(key: str) -> None:
    """JSON's ``Infinity`` (or ``1e999``) was accepted: ``close_timeout_s`` then made shutdown
    raise ``OverflowError`` from a thread join (the tier kept vLLM's region mapped and never
    ended its sessions), the others waited without bound; an integer too large for a float
    raised ``OverflowError`` instead of naming the key."""
    for value in (float("inf"), float("nan"), 10**400):
        with pytest.raises(ValueError, match=f'"{key}" must be'):
            RemoteHostTierConfig.from_options({"remote": "127.0.0.1:1", key: value})


def test_the_jobs_table_does_not_keep_its_tier_alive(no_gc: None) -> None:
    """``TierJobs`` holds its tier's promotion callback weakly: a strong bound method made a
    cycle (tier -> jobs -> method -> tier) that kept the tier, and its NIXL agent, alive until
    the garbage collector ran."""

    class Owner:
        def __init__(self) -> None:
            self.jobs = TierJobs(self.promoted)

        def promoted(self, req_context: Any, landed: Any, failed: Any) -> None: ...

    owner = Owner()
    gone = weakref.ref(owner)
    del owner
    assert gone() is None


def test_failed_nixl_setup_releases_the_primary_region(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.cpu.shared_offload_region")
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):  # NIXL's own exception type
        make_manager("127.0.0.1:1", backends=["NO_SUCH_BACKEND"])
    assert "Removed mmap file" in caplog.text
    assert "Keeping" not in caplog.text


def test_block_len_mismatch_names_the_server_flag(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.cpu.shared_offload_region")
    with (
        ServerProcess.start(REMOTE_BLOCKS, 2 * CHUNK_BYTES) as srv,
        pytest.raises(RuntimeError, match=f"--block-len {CHUNK_BYTES}"),
    ):
        make_manager(srv.address)
    # The failed tier released its views, so vLLM's cleanup could unmap the shared region.
    assert "Removed mmap file" in caplog.text
    assert "Keeping" not in caplog.text


def test_a_remote_host_down_at_startup_is_connected_when_it_comes_up() -> None:
    port = free_port()  # nothing listens there (yet)
    address = f"127.0.0.1:{port}"
    with pytest.raises(RuntimeError, match="could not connect"):  # reconnecting off: fail fast
        make_manager(address, reconnect_interval_s=0, connect_timeout_s=0.5)
    with driven_manager(address, reconnect_interval_s=0.2, connect_timeout_s=0.5) as (
        spec,
        _,
        driver,
    ):
        tier = driver.tier.tier_manager
        assert tier.peers() == []  # vLLM started without the host
        early = keys_for("early", 2)
        driver.store("req-a", early)  # its cascades fail: there is no host yet
        driver.run_until_idle()
        assert not any(tier.contains(k) for k in early)
        with ServerProcess.start(REMOTE_BLOCKS, CHUNK_BYTES, extra_args=["--port", str(port)]):
            wait_until(lambda: bool(tier.peers()), "the tier connects the late host", 20.0)
            late = keys_for("late", 2)
            driver.store("req-b", late)
            driver.run_until_idle()
            assert all(tier.contains(k) for k in late)
            driver.shutdown(spec)


def test_hosts_that_do_not_answer_at_startup_are_dialled_side_by_side() -> None:
    """Found by review: startup connected its remote hosts one after another, so N hosts that
    do not answer held vLLM's startup for N x ``connect_timeout_s`` (4 hosts down: 40 s by
    default). They are dialled side by side now: about one ``connect_timeout_s`` in all."""
    silent = SilentHosts(4)
    with contextlib.closing(silent), concurrent.futures.ThreadPoolExecutor(1) as pool:
        built = pool.submit(
            make_manager, silent.addresses, reconnect_interval_s=60, connect_timeout_s=5
        )
        dialled = silent.dialled_side_by_side(within=4.0)
        spec, manager = built.result(timeout=60)
        driver = Driver(manager)
        assert driver.tier.tier_manager.peers() == []  # vLLM started without them
        driver.shutdown(spec)
    assert dialled, "each host was dialled only once the one before it gave up"


def test_startup_fails_for_the_first_listed_host_that_cannot_be_used() -> None:
    """Hosts dialled side by side fail startup as when dialled in turn: for the first host of
    the source (a static list is sorted) that failed, with what to check; a host that refuses
    fails it at once, ending the handshakes still waiting for a silent host, and no connect is
    left running after."""
    silent = SilentHosts(2, host="127.0.0.2")  # listed after 127.0.0.1's hosts
    with contextlib.closing(silent):
        first = min(silent.addresses)
        with pytest.raises(RuntimeError, match=f"could not connect to remote host {first}"):
            make_manager(silent.addresses, reconnect_interval_s=0, connect_timeout_s=0.5)
        with (
            ServerProcess.start(REMOTE_BLOCKS, 2 * CHUNK_BYTES) as refusing,
            pytest.raises(RuntimeError, match=f"(?s)host {refusing.address}: .*--block-len"),
        ):  # a silent host would be left to the membership thread; one that refuses fails startup
            make_manager([*silent.addresses, refusing.address], connect_timeout_s=60)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tkvt-connect")]


def test_a_remote_host_full_at_startup_is_connected_once_it_has_room() -> None:
    """Found by review: a host at its ``--max-sessions`` (or with every slot leased) at vLLM's
    startup failed the startup, though waiting mends it, as ``connect(...,
    redial_if_down=True)`` judges it (``HandshakeRejected.busy``). With reconnecting on, vLLM
    starts without it and the membership thread connects it once it has room; with it off,
    startup fails, saying how to start without it."""
    with ServerProcess.start(
        REMOTE_BLOCKS, CHUNK_BYTES, extra_args=["--max-sessions", "1"]
    ) as host:
        holder = fake_session(host.address, block_len=CHUNK_BYTES, slots=TIER_SLOTS)
        try:
            with pytest.raises(RuntimeError, match="(?s)too many sessions.*reconnect_interval_s"):
                make_manager(host.address, reconnect_interval_s=0)
            with driven_manager(host.address, reconnect_interval_s=0.2) as (spec, _, driver):
                tier = driver.tier.tier_manager
                assert tier.peers() == []  # vLLM started without the host
                holder.close()
                wait_until(lambda: bool(tier.peers()), "the tier connects the host", 20.0)
                driver.shutdown(spec)
        finally:
            holder.close()


def test_default_namespace_separates_models_and_layouts_and_joins_equal_engines() -> None:
    from types import SimpleNamespace

    from torch_kv_tier.integrations.vllm.tier_config import default_config_fields

    def spec(model: str, tokens: int = 16, tp: int = 1) -> Any:
        return SimpleNamespace(
            config=SimpleNamespace(
                model=SimpleNamespace(name=model, dtype="bfloat16"),
                cache=SimpleNamespace(tokens_per_hash=tokens, blocks_per_chunk=2),
                parallel=SimpleNamespace(tp_size=tp, pp_size=1),
            )
        )

    same = default_config_fields(spec("llama"), 65536)
    assert same == default_config_fields(spec("llama"), 65536)  # two engines of one model
    assert same["model"] == "llama" and same["chunk_bytes"] == "65536"
    for other in (spec("qwen"), spec("llama", tokens=32), spec("llama", tp=2)):
        assert default_config_fields(other, 65536) != same
    assert default_config_fields(spec("llama"), 32768) != same
    assert default_config_fields(SimpleNamespace(), 4096) == {"chunk_bytes": "4096"}


@pytest.mark.parametrize(
    ("primary_chunks", "concurrency", "warns"),
    [(16, 4, "can never promote"), (2048, 16, "promotes only"), (4096, 16, None)],
)
def test_startup_sizing_names_the_cpu_bytes_to_use(
    server: ServerProcess,
    caplog: pytest.LogCaptureFixture,
    primary_chunks: int,
    concurrency: int,
    warns: str | None,
) -> None:
    """2000-token prefixes of 16-token chunks need 125 chunks each, promotions half the tier:
    4 concurrent ones need 1000 chunks; 16 need 4000."""
    caplog.set_level(logging.INFO, logger="torch_kv_tier.integrations.vllm.tier_sizing")
    extra = {"expected_concurrency": concurrency, "expected_prefix_tokens": 2000}
    spec, manager = make_manager(server.address, **extra, primary_chunks=primary_chunks)
    Driver(manager).shutdown(spec)
    need = tier_sizing.recommended_cpu_bytes(concurrency, 2000, 16, CHUNK_BYTES)
    assert need >= concurrency * 125 * 2 * CHUNK_BYTES
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name == tier_sizing.__name__
    ]
    if warns is None:
        assert not warnings
    else:
        (message,) = warnings
        assert warns in message and f">= {need}" in message
