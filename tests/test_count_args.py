"""Counts and tokens as users pass them: a tier's sizes and a private lease's ``slots`` are
whole numbers (numpy's taken, as the int the protocol carries) or refused naming the parameter
before anything is allocated or dialled (``quantities.count``); a token read from a file with
its newline (by the readers this library has) joins a host, inner spaces and all; a server
started with a bad argument leaves nothing running."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from late_write_support import LateWriteTransport
from remote_support import BLOCK_LEN

from torch_kv_tier.arena import BlockArena
from torch_kv_tier.benchmarks.remote import read_token
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader
from torch_kv_tier.integrations.vllm.tier_config import _read_token
from torch_kv_tier.manager import TierManager
from torch_kv_tier.remote import ServerProcess

NOT_COUNTS = [True, 4.5, math.nan, "4", np.float64(4.0), 0, -1, 2**70]


@pytest.mark.parametrize("slots", NOT_COUNTS, ids=repr)
def test_slots_that_are_no_count_are_refused_before_dialling(slots: object) -> None:
    """Found by review: ``connect(private=True, slots=True)`` (or ``4.5``, NaN) was sent to
    the host, which never answered it: the connect raised ``AcceptLost`` after its whole
    ``timeout_s``; ``slots=2**70`` raised ``OverflowError`` from the encoder after the socket
    was made. Each is refused naming ``slots`` before anything is dialled (the address is a
    closed port: a dial would wait out ``timeout_s`` and raise ``TimeoutError``)."""
    arena = BlockArena(4, BLOCK_LEN)
    with TierManager(arena, LateWriteTransport(arena.tensor)) as tier:
        with pytest.raises((TypeError, ValueError), match="^slots must be"):
            tier.connect("127.0.0.1:1", private=True, slots=slots, timeout_s=5)  # type: ignore[arg-type]
        assert tier.peers() == []


@pytest.mark.parametrize("name", ["num_blocks", "block_len"])
@pytest.mark.parametrize("value", NOT_COUNTS, ids=repr)
def test_an_arena_of_no_count_is_refused_naming_it(name: str, value: Any) -> None:
    """Found by review: ``BlockArena(16.0, ...)`` (or ``True``) raised torch's ``TypeError``
    "empty() takes 1 positional argument but 2 were given", naming nothing, and
    ``block_len=True`` made an arena of 1-byte blocks. Each is refused naming the parameter."""
    sizes = {"num_blocks": 4, "block_len": BLOCK_LEN, name: value}
    with pytest.raises((TypeError, ValueError), match=f"^{name} must be"):
        BlockArena(**sizes)


def test_an_arena_of_numpy_ints_is_made() -> None:
    """numpy's ints are taken, as the ints they are."""
    arena = BlockArena(np.int32(4), np.int64(BLOCK_LEN))  # type: ignore[arg-type]
    assert arena.tensor.shape == (4, BLOCK_LEN)
    assert (type(arena.num_blocks), type(arena.block_len)) == (int, int)


@pytest.mark.parametrize("value", NOT_COUNTS, ids=repr)
def test_an_offloader_of_no_count_of_arena_blocks_is_refused_naming_it(value: Any) -> None:
    """Found by review: ``PagedKVOffloader.create(..., arena_blocks=4.5)`` got past its check
    to fail in torch naming nothing, ``"4"`` in a comparison. Refused naming ``arena_blocks``,
    before a tier is made."""
    keys = [torch.zeros(4, 4, 2, 64) for _ in range(2)]
    values = [torch.zeros(4, 4, 2, 64) for _ in range(2)]
    with pytest.raises((TypeError, ValueError), match="^arena_blocks must be"):
        PagedKVOffloader.create(keys, values, arena_blocks=value)


@pytest.mark.parametrize("name", ["max_inflight", "grant_batch"])
@pytest.mark.parametrize("value", NOT_COUNTS, ids=repr)
def test_a_tier_built_with_no_count_is_refused_naming_it(name: str, value: Any) -> None:
    """Found by review: ``TierManager(max_inflight=True)``, ``max_inflight=4.5`` or
    ``grant_batch=4.5`` were taken, a string failed in a comparison naming nothing. Each is
    refused naming the parameter, before the tier starts."""
    arena = BlockArena(4, BLOCK_LEN)
    with pytest.raises((TypeError, ValueError), match=f"^{name} must be"):
        TierManager(arena, LateWriteTransport(arena.tensor), **{name: value})


@pytest.mark.parametrize("token", [b"secret", 5], ids=repr)
def test_a_token_that_is_no_str_is_refused_before_dialling(token: Any) -> None:
    """Found by review: ``connect(token=b"secret")`` was dialled (a closed port: it waited out
    ``timeout_s``), ``token=5`` raised ``AttributeError: 'int' object has no attribute
    'strip'``. Both are a ``TypeError`` naming ``token`` before anything is dialled."""
    arena = BlockArena(4, BLOCK_LEN)
    with TierManager(arena, LateWriteTransport(arena.tensor)) as tier:
        with pytest.raises(TypeError, match="^token must be a str"):
            tier.connect("127.0.0.1:1", token=token, timeout_s=5)
        assert tier.peers() == []


def test_numpy_counts_and_a_token_file_with_its_newline_join_a_host(tmp_path: Path) -> None:
    """Found by review: ``slots=numpy.int64(4)`` raised ``TypeError`` (numpy.int64 cannot be
    encoded) once the handshake was under way; a tier built with ``grant_batch=numpy.int64(8)``
    lost its shared host at its first grant request (the session's I/O thread failed encoding
    it) and its store failed. The lease has 4 slots; the store is stored. The host's token has
    inner spaces and its file a newline: the readers of the vLLM config's ``token_file`` and of
    the benchmarks' ``--token-file`` give the token the host has, which joins it."""
    token_file = tmp_path / "token"
    token_file.write_text("a shared  secret\n")
    token_file.chmod(0o600)
    token = _read_token(str(token_file))
    assert token == read_token(str(token_file)) == "a shared  secret"
    with (
        ServerProcess.start(16, BLOCK_LEN, token_file=str(token_file)) as server,
        TierManager.create(8, BLOCK_LEN, name="numpy-slots") as tier,
        TierManager.create(16, BLOCK_LEN, name="numpy-grants", grant_batch=np.int64(8)) as shared,  # type: ignore[arg-type]
    ):
        peer = tier.connect(server.address, token=token, private=True, slots=np.int64(4))  # type: ignore[arg-type]
        assert tier.stats().peers[peer].capacity == 4
        with pytest.raises(ValueError, match="surrounding whitespace"):
            tier.connect(server.address, token=token_file.read_text())
        shared.connect(server.address, token=token)
        stored = shared.store(list(range(12)), list(range(12))).result(timeout=30)
        assert stored.ok, stored.failed


@pytest.mark.parametrize(
    ("num_blocks", "extra_args", "error", "says"),
    [
        (-1, (), ValueError, "^num_blocks must be > 0"),
        (4.5, (), TypeError, "^num_blocks must be a whole number"),
        (16, ("--bogus",), RuntimeError, "unrecognized arguments"),
        (16, ("--max-lease", "0"), RuntimeError, "--max-lease"),
        (2**61, (), RuntimeError, "no machine holds such a pool"),  # (x BLOCK_LEN > 2**62 B)
        (2**70, (), ValueError, "^num_blocks must be > 0 and at most"),  # past the wire's
        (
            16,
            ("--lease-timeout", "1e300"),
            RuntimeError,
            "--lease-timeout must be at least 1 s and at",
        ),
    ],
)
def test_a_server_started_with_a_bad_argument_leaves_nothing_running(
    num_blocks: object, extra_args: tuple[str, ...], error: type[Exception], says: str
) -> None:
    """A bad argument to ``ServerProcess.start`` raises ``RuntimeError`` with the server's
    complaint and leaves no process behind (found right by review; kept so). Found by review:
    ``--num-blocks 2**70`` printed numpy's traceback, "Maximum allowed dimension exceeded"
    (a pool that fits no machine but numpy's array is "cannot start: Unable to allocate");
    it is now refused as the other bad options are, naming them. A count that is no whole
    number > 0 (or past the wire's) is refused before any process starts (``quantities.count``)."""
    children = psutil.Process().children()
    with pytest.raises(error, match=says):
        ServerProcess.start(num_blocks, BLOCK_LEN, extra_args=extra_args)  # type: ignore[arg-type]
    assert psutil.Process().children() == children
