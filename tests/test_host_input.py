"""What a host is given, by its operator or by a client's frame, is checked before it touches
anything: slot numbers that are no ints, slots no grant could name, a negative grant, and
``serve``'s durations and counts (``quantities``), each refused naming the problem."""

from __future__ import annotations

import argparse
import pathlib
import threading

import numpy as np
import psutil
import pytest
from remote_support import BLOCK_LEN

from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote import protocol as p
from torch_kv_tier.remote.client import RemoteSession
from torch_kv_tier.remote.leases import Session, SlotPool
from torch_kv_tier.remote.server import Server
from torch_kv_tier.remote.server_config import ServerConfig, add_arguments
from torch_kv_tier.remote.shared_service import SharedService


@pytest.mark.parametrize("bad", [1.7, "1", True, None, np.float64(1.0)], ids=repr)
def test_slots_given_back_that_are_no_ints_are_refused_and_the_pool_unchanged(
    bad: object,
) -> None:
    """``give_back_slots([1.7])`` freed slot 1 (numpy truncated it), ``["1"]`` too; ``True``
    freed slot 1. Refused, naming the value, before the pool changes; numpy's ints are taken."""
    pool = SlotPool(4)
    assert pool.take(4) == range(4)
    with pytest.raises(TypeError, match=r"^slots must be ints .* got "):
        pool.give_back_slots([3, bad])  # type: ignore[list-item]
    assert pool.free == 0
    with pytest.raises(ValueError, match="outside"):
        pool.give_back_slots([2**64])  # no slot of any pool: not an OverflowError
    pool.give_back_slots([np.int64(1), np.uint32(2), 3])  # type: ignore[list-item]
    assert pool.free == 3 and pool.take(3) == range(1, 4)


def _shared_session(service: SharedService) -> tuple[Session, list[int]]:
    session = Session("sid", "s1", "rogue", range(0), 0.0, 0.0, shared=True, namespace="m")
    service.join(session)
    granted = service.answer(session, p.GrantRequest(1, "sid", 2), 0.0)
    assert isinstance(granted, p.Granted) and len(granted.slots) == 2
    return session, granted.slots


@pytest.mark.parametrize("bad", [-1, 8, 2**64 - 1], ids=repr)
def test_a_commit_naming_a_slot_outside_the_pool_is_answered_and_stores_nothing(bad: int) -> None:
    """Such a commit published its other keys and dropped that one without a word (counted as
    a refused slot, as a slot of another session's is): it is refused whole with an ``Error``
    naming the host's range, and the session still holds its grants."""
    service = SharedService(SlotPool(8), quota=None, max_granted=4)
    session, slots = _shared_session(service)
    commit = p.Commit(2, "sid", [b"good", b"bad"], [slots[0], bad], [1, 2])
    reply = service.answer(session, commit, 0.0)
    assert isinstance(reply, p.Error) and reply.reason == "slots must be in [0, 8) on this host"
    cache = service.cache
    assert (cache.stored, cache.granted, cache.refused) == (0, 2, 0)
    assert service.answer(session, p.Commit(3, "sid", [b"good"], slots[:1], [1]), 0.0) is None
    assert cache.stored == 1


def test_a_grant_for_fewer_than_no_slots_is_answered_with_an_error() -> None:
    """``GrantRequest(want=-5)`` was granted nothing, as if the host had no slot to give."""
    service = SharedService(SlotPool(8), quota=None, max_granted=4)
    session, _ = _shared_session(service)
    reply = service.answer(session, p.GrantRequest(2, "sid", -5), 0.0)
    assert isinstance(reply, p.Error) and reply.reason == "want must be >= 0 slots, got -5"
    assert service.cache.granted == 2


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--num-blocks", "8", "--block-len", "64", *argv])


@pytest.mark.parametrize("option", ["--lease-timeout", "--hold-timeout"])
@pytest.mark.parametrize("bad", ["1e300", "1e7", "0", "-1", "nan", "inf"])
def test_serve_refuses_a_duration_no_wait_takes_naming_the_option(option: str, bad: str) -> None:
    """``--lease-timeout 1e300`` (or ``--hold-timeout``) was taken: the bound every other
    timeout has (``quantities.MAX_WAIT_S``) applies, and the error says what to pass."""
    with pytest.raises(
        ValueError, match=rf"^{option} must be at least 1 s and at most 1e\+06 s, got"
    ):
        ServerConfig.from_args(_args(f"{option}={bad}"))


@pytest.mark.parametrize(
    "option", ["--max-sessions", "--disk-admit", "--max-lease", "--max-grant", "--num-blocks"]
)
def test_serve_refuses_a_count_past_what_the_wire_carries_naming_the_option(option: str) -> None:
    """``--max-sessions 10**30`` was taken; ``--disk-admit 0`` and the rest already refused."""
    for bad in (str(2**64), "0", "-3"):
        with pytest.raises(ValueError, match=rf"^{option} must be"):
            ServerConfig.from_args(_args(f"{option}={bad}"))


@pytest.mark.parametrize(
    "field, bad",
    [
        ("lease_timeout_s", "30"),
        ("hold_timeout_s", True),
        ("num_blocks", 8.0),
        ("block_len", True),
        ("max_sessions", "4"),
    ],
)
def test_a_config_given_no_number_is_a_type_error_naming_the_option(
    field: str, bad: object
) -> None:
    """``ServerConfig(num_blocks=True)`` failed at start with ``an integer is required``, and
    ``lease_timeout_s="30"`` in a comparison, naming nothing."""
    with pytest.raises(TypeError, match=r"^--[a-z-]+ must be"):
        ServerConfig(**{"num_blocks": 8, "block_len": BLOCK_LEN, field: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "error"), [(8192.5, TypeError), ("8192", TypeError), (10**30, ValueError)], ids=repr
)
def test_a_disk_size_no_count_is_refused_naming_the_option_before_the_pool(
    bad: object, error: type[Exception], tmp_path: pathlib.Path
) -> None:
    """``ServerConfig(disk_bytes=8192.5)`` (or ``10**30``) was taken: the host allocated and
    registered its pool and created the disk file, then failed with "'float' object cannot be
    interpreted as an integer" (an ``OverflowError``), naming nothing. A numpy int is taken."""
    with pytest.raises(error, match=r"^--disk-bytes must be"):
        ServerConfig(8, BLOCK_LEN, disk_paths=(str(tmp_path),), disk_bytes=bad)  # type: ignore[arg-type]
    taken = ServerConfig(8, BLOCK_LEN, disk_paths=(str(tmp_path),), disk_bytes=np.int64(8192))  # type: ignore[arg-type]
    assert type(taken.disk_bytes) is int


def test_a_host_configured_with_numpy_numbers_answers_a_handshake() -> None:
    """``ServerConfig(lease_timeout_s=numpy.float32(30))`` started, and its loop died at the
    first ``Accept`` (msgspec cannot encode a ``numpy.float32``): the client got no answer
    (``AcceptLost``), nor did any other. Numbers are stored as the ``float``/``int`` they are."""
    config = ServerConfig(
        num_blocks=np.int64(16),  # type: ignore[arg-type]
        block_len=np.int32(BLOCK_LEN),  # type: ignore[arg-type]
        lease_timeout_s=np.float32(30.0),  # type: ignore[arg-type]
        hold_timeout_s=np.float32(60.0),  # type: ignore[arg-type]
    )
    assert (type(config.num_blocks), type(config.lease_timeout_s)) == (int, float)
    server = Server(config)
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,))
    loop.start()
    try:
        region = p.Region(4096, 8, BLOCK_LEN)
        session = RemoteSession.open(server.address, agent_metadata=b"m", region=region)
        assert session.num_blocks == 16
        session.close()
    finally:
        stop.set()
        loop.join()
        server.close()


@pytest.mark.parametrize("field", ["port", "metrics_port"])
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (True, TypeError),
        (1.5, TypeError),
        (float("nan"), TypeError),
        ("5600", TypeError),
        (-1, ValueError),
        (65536, ValueError),
        (2**70, ValueError),
    ],
    ids=repr,
)
def test_a_port_that_is_no_port_number_is_refused_naming_the_option(
    field: str, bad: object, error: type[Exception]
) -> None:
    """``ServerConfig(port=1.5)`` listened on port 1 (ZeroMQ read ``tcp://127.0.0.1:1.5``);
    ``port=True`` and ``metrics_port=1.5`` failed only as they bound, after the control port,
    with errors naming no option (a ``TypeError`` traceback from ``serve``)."""
    option = "--" + field.replace("_", "-")
    with pytest.raises(error, match=rf"^{option} must be"):
        ServerConfig(8, BLOCK_LEN, **{field: bad})  # type: ignore[arg-type]
    taken = ServerConfig(8, BLOCK_LEN, **{field: np.int64(0)})  # type: ignore[arg-type]
    assert type(getattr(taken, field)) is int


@pytest.mark.parametrize("option", ["--lease-timeout", "--hold-timeout"])
@pytest.mark.parametrize("short", ["0.001", "1e-9", "0.5"])
def test_serve_refuses_a_timeout_shorter_than_a_second_saying_what_to_pass(
    option: str, short: str
) -> None:
    """``--lease-timeout 0.001`` was taken: each session's tier heartbeated every 0.33 ms (a
    third of it; 15% of a core per session), a tier paused for the host's 0.1 s expiry period
    lost its session, and ``--hold-timeout 0.001`` gave slots back before their tier could
    notice its session had ended and release them. A second is the least either takes."""
    with pytest.raises(
        ValueError, match=rf"^{option} must be at least 1 s and at most 1e\+06 s, got .*: .*pass"
    ):
        ServerConfig.from_args(_args(f"{option}={short}"))
    assert ServerConfig.from_args(_args(f"{option}=1")) is not None


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("host", 5),
        ("token", 5),
        ("token", b"secret"),
        ("host_id", 5),
        ("config_fields", [1]),
        ("disk_paths", "/mnt/nvme0"),
        ("disk_paths", [1]),
    ],
    ids=repr,
)
def test_a_config_field_of_another_type_is_a_type_error_naming_the_field(
    field: str, bad: object
) -> None:
    """``ServerConfig(token=5)`` (or ``config_fields=[1]``) was taken, to fail only later (a
    token, at the first client's proof); ``host=5`` was read as the address 0.0.0.5 and
    refused for want of a token; ``host_id=5`` raised ``len()``'s
    "object of type 'int' has no len()", naming nothing; ``disk_paths="/mnt/nvme0"`` was
    refused as naming a directory twice (``['/', 'm', 'n', ...]``). Each is refused, naming the
    field and its option and saying what to pass, before anything is allocated or bound."""
    option = {"token": "token-file", "config_fields": "config-fields", "disk_paths": "disk"}
    flag = "--" + option.get(field, field.replace("_", "-"))
    kwargs = {"disk_bytes": 8 * BLOCK_LEN} if field == "disk_paths" else {}
    with pytest.raises(
        TypeError, match=rf"^ServerConfig field {field} \({flag}\) must be .*pass e"
    ):
        ServerConfig(8, BLOCK_LEN, **{field: bad}, **kwargs)  # type: ignore[arg-type]


def test_a_list_of_disk_paths_is_taken_as_the_tuple_the_config_declares(
    tmp_path: pathlib.Path,
) -> None:
    """A user writes ``disk_paths=[...]`` (or ``pathlib.Path`` entries): taken, and stored as
    the tuple of ``str`` the field declares."""
    paths = [tmp_path / "a", str(tmp_path / "b")]
    config = ServerConfig(8, BLOCK_LEN, disk_paths=paths, disk_bytes=8 * BLOCK_LEN)  # type: ignore[arg-type]
    assert config.disk_paths == (str(tmp_path / "a"), str(tmp_path / "b"))


def test_an_empty_token_is_refused_saying_what_to_pass() -> None:
    """``ServerConfig(token="")`` was taken, yet no client can pass an empty token (its
    ``connect`` refuses one), so no client could ever join that host."""
    with pytest.raises(ValueError, match="^token must not be empty: pass a long random"):
        ServerConfig(8, BLOCK_LEN, token="")


@pytest.mark.parametrize(("field", "bad"), [("num_blocks", 16.0), ("block_len", True)], ids=repr)
def test_a_server_process_given_no_count_is_refused_before_it_starts(
    field: str, bad: object
) -> None:
    """``ServerProcess.start(16.0, ...)`` started the server process, whose ``serve`` then
    refused ``--num-blocks 16.0`` (a ``RuntimeError`` quoting its stderr, after a process
    start). Refused naming the parameter, and no process started."""
    children = psutil.Process().children()
    counts = {"num_blocks": 16, "block_len": BLOCK_LEN, field: bad}
    with pytest.raises(TypeError, match=rf"^{field} must be a whole number"):
        ServerProcess.start(counts["num_blocks"], counts["block_len"])  # type: ignore[arg-type]
    assert psutil.Process().children() == children
