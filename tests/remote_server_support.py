"""What the ``torch-kv-tier serve`` tests (``test_remote_server*.py``) share: module-scoped
hosts (one with a token and model config fields, one open on loopback), one raw message
exchanged with a host, and a host's metrics page."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from remote_support import BLOCK_LEN, TOKEN

from torch_kv_tier.remote import ServerProcess
from torch_kv_tier.remote import protocol as p

CONFIG = {"model": "tiny-llama", "dtype": "bfloat16"}  # the token host's model config fields
POOL = 96  # the token host's slots


def module_token_server() -> Any:
    """A module-scoped fixture ``token_server``: a host of ``POOL`` slots with a token
    (``TOKEN``, from a file), ``CONFIG``'s model config fields and a metrics port, started once
    for the test module that assigns it (``token_server = module_token_server()``); every test
    leaves its pool free."""

    @pytest.fixture(scope="module", name="token_server")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        token_file = tmp_path_factory.mktemp("token") / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        with ServerProcess.start(
            POOL,
            BLOCK_LEN,
            token_file=str(token_file),
            config_fields=CONFIG,
            extra_args=["--metrics-port", "0"],
        ) as host:
            yield host

    return server


def module_open_server() -> Any:
    """A module-scoped fixture ``open_server``: a loopback host without a token that reclaims
    silent clients' leases after 1 s, started once for the test module that assigns it
    (``open_server = module_open_server()``)."""

    @pytest.fixture(scope="module", name="open_server")
    def server() -> Iterator[ServerProcess]:
        with ServerProcess.start(32, BLOCK_LEN, extra_args=["--lease-timeout", "1"]) as host:
            yield host

    return server


def exchange(address: str, frames: list[bytes], wait_s: float = 5.0) -> p.ServerMessage | None:
    """Send one (multi-part) message from a fresh DEALER; the decoded reply, or ``None``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart(frames)
        if not sock.poll(int(wait_s * 1e3)):
            return None
        return p.decode_server(sock.recv())
    finally:
        sock.close(linger=0)


def metrics_page(port: int) -> str:
    """The metrics page a host serves on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())
