"""``torch-kv-tier chaos`` and hosts that exit by themselves (``benchmarks.chaos_hosts``): the
harness saw none (an exited host stayed down until a random kill restarted it, its exit never
reported); each is now recorded, restarted on its port, and fails the run unless it is the UCX
abort the README documents over TCP."""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest

from torch_kv_tier.benchmarks.chaos import Chaos, add_arguments, render
from torch_kv_tier.benchmarks.chaos_hosts import (
    STDERR_LINES,
    HostExit,
    Hosts,
    host_exit,
    is_known_ucx_abort,
)

UCX_ABORT = "[1733560000.1] ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout"


@pytest.mark.parametrize(
    ("returncode", "stderr", "tcp", "known"),
    [
        (-6, f"INFO serving\n{UCX_ABORT}", True, True),
        (-6, "stubs.c:107 Assertion '0' failed", True, True),
        (-6, f"INFO serving\n{UCX_ABORT}", False, False),  # documented over TCP only
        (-6, "Traceback ... AssertionError", True, False),  # an abort, not UCX's
        (-11, UCX_ABORT, True, False),  # a crash
        (1, UCX_ABORT, True, False),
        (0, "", True, False),
    ],
)
def test_only_the_documented_ucx_abort_over_tcp_is_a_known_exit(
    returncode: int, stderr: str, tcp: bool, known: bool
) -> None:
    assert is_known_ucx_abort(returncode, stderr, tcp=tcp) is known


def test_a_ucx_abort_followed_by_its_backtrace_is_known_and_the_end_of_stderr_kept() -> None:
    """The exit was judged on the lines it kept (the last 20): a UCX abort followed by a longer
    backtrace would have failed the run as an unexpected exit."""
    backtrace = "\n".join(f"  {i} 0x7f00 ucs_debug_backtrace_dump()" for i in range(40))
    found = host_exit("h:1", 3.14159, -6, f"INFO serving\n{UCX_ABORT}\n{backtrace}", tcp=True)
    assert found.known and (found.signal, found.at_s) == ("SIGABRT", 3.1)
    assert found.stderr.splitlines() == backtrace.splitlines()[-STDERR_LINES:]


def test_a_host_that_exits_by_itself_is_recorded_and_restarted_on_its_port() -> None:
    started = time.monotonic()
    hosts = Hosts(1, None, 64, tcp=True, started=started)
    try:
        address = hosts.addresses[0]
        hosts.restart(0)  # the harness's own kill: no exit of its own
        assert hosts.exits == [] and hosts.exited() == []
        aborted_at = time.monotonic() - started
        os.kill(hosts.servers[0].proc.pid, signal.SIGABRT)
        hosts.servers[0].proc.wait(timeout=30)
        time.sleep(1.0)  # the harness finds an exit some time after it (between two faults)
        assert hosts.exited() == [0]
        hosts.restart(0)
        assert hosts.addresses == [address] and hosts.exited() == []
        assert hosts.restarts == 2
        [found] = hosts.exits
        assert (found.host, found.returncode, found.signal) == (address, -6, "SIGABRT")
        assert not found.known  # no UCX message on its stderr
        assert aborted_at - 0.1 <= found.at_s < aborted_at + 0.9  # when it exited, not found
        assert "serving" in found.stderr  # the end of its log
    finally:
        hosts.close()
    assert len(hosts.exits) == 1  # close stops the live host: not an exit of its own


def _exit(returncode: int, known: bool) -> HostExit:
    name = signal.Signals(-returncode).name
    return HostExit("127.0.0.1:5600", 12.5, returncode, name, known, "the end of its stderr")


def test_the_run_fails_on_an_unexpected_host_exit_and_reports_a_known_one() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    chaos = Chaos(parser.parse_args(["--tcp"]))
    chaos.exits = [_exit(-6, known=True)]
    chaos.report([], restarts=1)
    figures = {f.name: f for f in chaos.out.figures}
    assert figures["host exits: the UCX abort documented over TCP"].value == 1
    assert figures["host exits: any other"].ok and not chaos.out.problems
    assert "exited at 12.5 s: exit code -6 (SIGABRT), the known UCX abort" in render(
        chaos.out, chaos.exits
    )

    chaos = Chaos(parser.parse_args(["--tcp"]))
    chaos.exits = [_exit(-6, known=True), _exit(-11, known=False)]
    chaos.report([], restarts=2)
    figures = {f.name: f for f in chaos.out.figures}
    assert figures["host exits: any other"].value == 1 and not figures["host exits: any other"].ok
    [problem] = chaos.out.problems
    assert "exit code -11 (SIGSEGV)" in problem and "the end of its stderr" in problem
    assert not chaos.out.ok


def test_a_host_that_exits_as_the_harness_kills_it_is_still_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: ``restart`` looked for an exit of the host's own, then SIGKILLed it.
    A host that exited just before the look was not yet reaped by its watch thread (which
    holds ``Popen``'s waitpid lock: ``poll`` says "running" meanwhile), so its exit (a crash,
    say) was taken for the harness's kill and never reported. An exit whose code is not the
    kill's is recorded."""
    hosts = Hosts(1, None, 64, tcp=False, started=time.monotonic())
    try:
        proc = hosts.servers[0].proc
        os.kill(proc.pid, signal.SIGSEGV)
        proc.wait(timeout=30)
        looks = iter([None])  # the first look: the watch thread reaping it meanwhile
        monkeypatch.setattr(proc, "poll", lambda: next(looks, proc.returncode))
        hosts.restart(0)
        [found] = hosts.exits
        assert (found.returncode, found.signal, found.known) == (-11, "SIGSEGV", False)
    finally:
        hosts.close()
