"""What a passive ``NixlTransport`` target costs when idle, and how fast it serves when woken.

A target process builds a ``NixlTransport`` with defaults and calls nothing on it after handing
out its metadata. Measured, per UCX transport (``tcp``, and UCX's default, shared memory on one
host) and per progress-thread delay (ours, ``nixl_agent.PROGRESS_DELAY_US``, and NIXL's default
0, the reference, in the same run: one target after the other, as a spinning reference would
take a core from ours, the reference first for every other transport):

- idle CPU: the target's process CPU time / wall time over ``--idle-s``, first with no peer
  connected, then after one initiator connected and wrote once (the connection stays open);
- first-byte latency: an initiator in this process (``passive_progress=False``, as a tier
  client) writes one block to the idle target and polls until done; ``--tries`` tries,
  ``--gap-ms`` apart so the target falls back asleep;
- what the thread costs an initiator: back-to-back 64-block writes (each polled to done) per
  second, initiator built with and without ``passive_progress`` (3 interleaved rounds each,
  which goes first swapping every round).

Run: ``python -m torch_kv_tier.benchmarks.passive_progress [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from torch_kv_tier.benchmarks.options import output_file
from torch_kv_tier.benchmarks.reliability_common import environment
from torch_kv_tier.cli_numbers import integer, real

BLOCK = 4096
NUM_BLOCKS = 256
START_TIMEOUT_S = 60.0  # the target's spawn, imports and NIXL agent, until its metadata
ANSWER_MARGIN_S = 30.0  # an idle-CPU answer's wait beyond the window it measures
WRITE_TIMEOUT_S = 10.0  # one write, posted to done


def _target(conn: Connection, env: dict[str, str], delay_us: int) -> None:
    os.environ.update(env)
    from torch_kv_tier.transport import NixlTransport, nixl_agent

    nixl_agent.PROGRESS_DELAY_US = delay_us
    region = torch.zeros(NUM_BLOCKS, BLOCK, dtype=torch.uint8)
    transport = NixlTransport("passive", region)
    conn.send((transport.get_agent_metadata(), transport.base_addr))
    while (cmd := conn.recv()) is not None:  # cmd: seconds to measure idle CPU for
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(cmd)
        conn.send((time.process_time() - c0) / (time.monotonic() - w0))
    transport.close()


def measure(tls: str | None, delay_us: int, idle_s: float, tries: int, gap_s: float) -> dict:
    from torch_kv_tier.transport import NixlTransport

    env = {"UCX_TLS": tls} if tls else {}
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, env, delay_us), daemon=True)
    with environment(env):  # UCX reads it as agents are created
        proc.start()
        child.close()  # the target's end: its exit ends this one's wait at once
        t = None
        try:
            metadata, base_addr = _answer(conn, START_TIMEOUT_S, "its agent metadata")
            conn.send(idle_s)
            idle_alone = _answer(conn, idle_s + ANSWER_MARGIN_S, "its idle CPU, no peer")
            t = NixlTransport(
                "initiator",
                torch.ones(NUM_BLOCKS, BLOCK, dtype=torch.uint8),
                passive_progress=False,
            )
            t.add_remote_peer("target", metadata, base_addr, NUM_BLOCKS, BLOCK)
            _write(t, [0])
            conn.send(idle_s)
            idle_peer = _answer(conn, idle_s + ANSWER_MARGIN_S, "its idle CPU, one peer")
            latencies = []
            for i in range(tries):
                time.sleep(gap_s)
                latencies.append(_write(t, [i % NUM_BLOCKS]))
            rates: dict[bool, list[float]] = {True: [], False: []}
            for r in range(3):
                for passive in (True, False) if r % 2 == 0 else (False, True):
                    rates[passive].append(_write_rate(metadata, base_addr, passive))
        finally:
            with contextlib.suppress(OSError):  # (it exited) a target that still reads ends
                conn.send(None)
            if t is not None:
                t.close()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    qs = statistics.quantiles(latencies, n=10)
    return {
        "ucx_tls": tls or "default",
        "progress_delay_us": delay_us,
        "idle_cpu_no_peer": idle_alone,
        "idle_cpu_one_peer": idle_peer,
        "latency_ms_median": statistics.median(latencies) * 1e3,
        "latency_ms_p90": qs[8] * 1e3,
        "tries": tries,
        "initiator_writes_per_s_with_thread": statistics.median(rates[True]),
        "initiator_writes_per_s_without_thread": statistics.median(rates[False]),
    }


def _write_rate(metadata: bytes, base_addr: int, passive: bool, seconds: float = 1.0) -> float:
    """64-block writes per second, each polled to done, from a fresh initiator."""
    from torch_kv_tier.transport import NixlTransport

    t = NixlTransport(
        "rate", torch.ones(NUM_BLOCKS, BLOCK, dtype=torch.uint8), passive_progress=passive
    )
    try:
        t.add_remote_peer("target", metadata, base_addr, NUM_BLOCKS, BLOCK)
        blocks = list(range(64))
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            _write(t, blocks)
            n += 1
        return n / (time.perf_counter() - start)
    finally:
        t.close()


def _answer(conn: Connection, timeout_s: float, what: str) -> Any:
    """The target's next message, waited for at most ``timeout_s``. Raises ``TimeoutError``
    (a frozen or stuck target) or ``RuntimeError`` (it exited), naming ``what`` was awaited."""
    try:
        if conn.poll(timeout_s):
            return conn.recv()
    except EOFError:
        raise RuntimeError(
            f"the target exited before sending {what}: see its output above"
        ) from None
    raise TimeoutError(
        f"the target did not send {what} within {timeout_s:g} s (frozen or stuck: see its "
        "output above); run the benchmark again"
    )


def _write(t: Any, blocks: list[int], timeout_s: float = WRITE_TIMEOUT_S) -> float:
    """Seconds to write ``blocks`` to the same blocks of the target, polled to done. Raises
    ``RuntimeError`` when the transport refuses or fails the write, ``TimeoutError`` when it is
    not done within ``timeout_s``."""
    start = time.perf_counter()
    tid = t.write_blocks("target", blocks, blocks)
    if tid is None:
        raise RuntimeError("the initiator refused a write to the target: see the log above")
    while True:
        result = t.poll()
        if tid in result.failed:
            raise RuntimeError("a write to the target failed: see the log above")
        if tid in result.done:
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"write not done within {timeout_s} s: the target does not serve")


def main(argv: list[str] | None = None) -> int:
    from torch_kv_tier.transport.nixl_agent import PROGRESS_DELAY_US

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-s", type=real, default=5.0, help="idle window (default 5 s)")
    parser.add_argument("--tries", type=integer, default=100, help="latency tries (default 100)")
    parser.add_argument("--gap-ms", type=real, default=20.0, help="between tries (default 20)")
    parser.add_argument("--json", type=output_file, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    delays = (PROGRESS_DELAY_US, 0)
    rows = []
    for n, tls in enumerate(("tcp", None)):
        measured = {
            delay: measure(tls, delay, args.idle_s, args.tries, args.gap_ms / 1e3)
            for delay in (delays if n % 2 == 0 else delays[::-1])
        }
        rows += [measured[delay] for delay in delays]  # the table's order: ours first
    print(
        "| UCX_TLS | progress delay | idle CPU, no peer | idle CPU, one peer | "
        "first-byte latency median / p90 | initiator 64-block writes/s, thread on / off |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['ucx_tls']} | {r['progress_delay_us'] / 1e3:g} ms | "
            f"{r['idle_cpu_no_peer']:.2%} | {r['idle_cpu_one_peer']:.2%} | "
            f"{r['latency_ms_median']:.3f} / {r['latency_ms_p90']:.3f} ms | "
            f"{r['initiator_writes_per_s_with_thread']:.0f} / "
            f"{r['initiator_writes_per_s_without_thread']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
