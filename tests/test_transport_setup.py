"""NixlTransport's setup around NIXL and UCX: a missing or broken NIXL says which and how to
install it, UCX's transport policy and backend parameters, NIXL's log lines kept off stdout, and
a process that used NIXL (even mid-registration) exits cleanly and in bounded time."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from remote_peer import RemotePeer
from transport_support import BLOCK

from torch_kv_tier.transport import (
    NixlTransport,
    nixl_agent,
)
from torch_kv_tier.transport.ucx_env import NO_SPLIT, apply_ucx_policy, ucx_backend_params

_UNAVAILABLE_PROBE = """
import sys
from torch_kv_tier.transport import NixlTransport
if sys.argv[1] == "absent":
    sys.modules["nixl"] = None  # as if nixl were not installed
t = NixlTransport("probe", memoryview(bytearray(4 * 64)).cast("B", (4, 64)))
try:
    t.write_blocks("peer", [0], [0])
except RuntimeError as exc:
    print(t.available, exc)
"""


@pytest.mark.parametrize("case", ["absent", "broken"])
def test_an_unavailable_nixl_says_whether_it_is_missing_or_broken(
    case: str, tmp_path: Path
) -> None:
    # A broken install (here: its native library missing, as in a trimmed wheel) must not be
    # reported as "not installed": the user would reinstall the wrong thing, or nothing.
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_api.py").write_text(
        'raise ImportError("libnixl.so: cannot open shared object file: No such file")\n'
    )
    path = [str(tmp_path)] if case == "broken" else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.getcwd()])}
    out = subprocess.run(
        [sys.executable, "-c", _UNAVAILABLE_PROBE, case],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert out.startswith("False ")
    if case == "absent":
        assert "NIXL is not installed: run `pip install nixl`" in out
    else:
        assert "installed but does not load" in out and "libnixl.so" in out
        assert "pip install --force-reinstall nixl" in out


# -- process-level behaviour ---------------------------------------------------------------------


def test_a_process_that_used_nixl_exits_zero(peer: RemotePeer) -> None:
    meta, addr, n, bl = peer.peer_args()
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        from torch_kv_tier.transport import NixlTransport
        t = NixlTransport("exiter", torch.ones(4, {bl}, dtype=torch.uint8))
        t.add_remote_peer("p", bytes.fromhex("{meta.hex()}"), {addr}, {n}, {bl})
        tid = t.write_blocks("p", [0, 1], [10, 11])
        deadline = time.monotonic() + 10
        while tid not in t.poll().done:
            assert time.monotonic() < deadline
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
    assert int(peer.get([10, 11]).sum()) == 2 * BLOCK


_EXIT_DURING_A_REGISTRATION = """
import sys, threading, torch
from torch_kv_tier.transport import NixlTransport
from torch_kv_tier.transport import nixl as nixl_module
nixl_module.CLOSE_REGISTRATION_WAIT_S = 0.2
target = NixlTransport("target", torch.zeros(4, 64, dtype=torch.uint8))
t = NixlTransport("exiting", torch.zeros(4, 64, dtype=torch.uint8))
entered, real, ending = threading.Event(), t._agent, sys.argv[1]

class Loading:  # a metadata load that takes a second ("slow") or never returns
    def __getattr__(self, name):
        if name != "add_remote_agent":
            return getattr(real, name)
        def load(*args):
            entered.set()
            threading.Event().wait(1.0 if ending == "slow" else None)
            return real.add_remote_agent(*args)
        return load

t._agent = Loading()
future = t.add_remote_peer_async("p", target.get_agent_metadata(), target.base_addr, 4, 64)
future.add_done_callback(lambda f: print("registered", f.exception() is None, flush=True))
assert entered.wait(30)
if ending == "close":
    t.close()
print("exiting", flush=True)
"""


@pytest.mark.parametrize(
    ("ending", "expected"),
    [
        ("close", "exiting\n"),
        ("no-close", "exiting\n"),
        ("slow", "exiting\nregistered True\n"),
    ],
)
def test_exit_during_a_registration_is_bounded_and_lets_a_slow_one_finish(
    ending: str, expected: str
) -> None:
    """Found by review: the registration thread was not a daemon, so interpreter exit joined it
    and a process whose peer registration never returned hung at exit for good, closed or not
    (close itself returns: ``CLOSE_REGISTRATION_WAIT_S``). A registration that is only slow
    still finishes before the interpreter ends (``registrar.EXIT_WAIT_S``): ended under it,
    NIXL aborted the process."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXIT_DURING_A_REGISTRATION, ending],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)
        pytest.fail("the process did not exit: interpreter exit waits for the registration")
    assert out == expected, err[-2000:]
    assert proc.returncode == 0, err[-2000:]


def test_nixl_log_lines_never_reach_stdout() -> None:
    script = (
        "import torch\n"
        "from torch_kv_tier.transport import NixlTransport\n"
        "NixlTransport('quiet', torch.zeros(2, 64, dtype=torch.uint8)).close()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "NIXL_LOG_LEVEL": "DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "ok\n"  # stdout is the application's (the server's `ready` line)
    assert "NIXL" in proc.stderr


def test_ucx_policy_excludes_ib_only_without_rdma_devices(tmp_path: Any) -> None:
    empty = tmp_path / "none"
    empty.mkdir()
    env: dict[str, str] = {}
    apply_ucx_policy(env, sysfs=empty)
    assert env == {"UCX_MODULES": "^ib"}
    with_dev = tmp_path / "ib"
    (with_dev / "mlx5_0").mkdir(parents=True)
    env = {}
    apply_ucx_policy(env, sysfs=with_dev)
    assert env == {}
    env = {"UCX_MODULES": ""}
    apply_ucx_policy(env, sysfs=empty)
    assert env == {"UCX_MODULES": ""}


def test_without_nixl_the_transport_is_unavailable_and_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.setattr(nixl_agent, "_api", None)
    t = NixlTransport("x", torch.zeros(2, 8, dtype=torch.uint8))
    assert t.available is False and not NixlTransport.is_available()
    with pytest.raises(RuntimeError, match="pip install nixl"):
        t.get_agent_metadata()
    t.close()


def test_ucx_backend_params_never_split_and_leave_out_rc_gda_on_gpu_hosts(tmp_path: Any) -> None:
    none = tmp_path / "none"
    none.mkdir()
    gpus = tmp_path / "gpus"
    (gpus / "0000:01:00.0").mkdir(parents=True)
    assert ucx_backend_params(4, procfs=none) == {"num_threads": "4", "split_batch_size": NO_SPLIT}
    assert ucx_backend_params(4, procfs=gpus) == {
        "num_threads": "4",
        "split_batch_size": NO_SPLIT,
        "engine_config": "TLS=^rc_gda",
    }
    assert ucx_backend_params(0, procfs=none) == {}  # no worker threads: NIXL never splits
