"""``torch-kv-tier serve`` that cannot listen says what to pass instead: a busy ``--port`` said
only ``Address already in use``, and a ``--host`` that is no address of this machine (a DNS
name ZeroMQ does not resolve, an IP of another machine) said ``No such device`` or ``Cannot
assign requested address``."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest
from remote_support import BLOCK_LEN

from torch_kv_tier.remote import ServerProcess


def test_a_busy_port_says_to_pass_another() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError) as info:
            ServerProcess.start(8, BLOCK_LEN, extra_args=["--port", str(port)])
    assert "code 1" in str(info.value)
    assert "pass another --port, or --port 0" in str(info.value)


def test_a_host_not_of_this_machine_says_what_host_takes(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a token")
    os.chmod(token, 0o600)
    with pytest.raises(RuntimeError) as info:
        ServerProcess.start(8, BLOCK_LEN, host="no-such-host.invalid", token_file=str(token))
    assert "code 1" in str(info.value)
    assert "--host must be an address of this machine" in str(info.value)


def test_a_privileged_port_says_to_pass_one_above_1024() -> None:
    from torch_kv_tier.remote.server import _bind_advice  # (as root, binding below 1024 works)

    assert "pass --port 1024 or above" in _bind_advice(errno.EACCES)
    assert _bind_advice(errno.EPERM) == ""  # no advice where none is known
