"""Writer A of the frozen-writer scenario (``frozen_writer``), run as its own process.

``python -m torch_kv_tier.benchmarks.frozen_writer_client HOST:PORT [options]``:

1. connects one tier (a private lease of ``--num-blocks`` slots, or the shared pool), fills its
   arena with ``0xAA``, stores one warm-up key (UCX wired up, grants in hand), prints
   ``{"event": "ready"}`` and waits for ``post`` on stdin (the parent stops the host first, so
   that over UCX/TCP no write can complete: the target drives its completion);
2. posts ``--stores`` stores of ``--first`` fresh keys each, prints
   ``{"event": "posted", "inflight": N, "queued": N, "done": N}`` (its tier's ``stats()`` right
   after posting) and **stops itself with SIGSTOP**, so the freeze lands while those writes
   are in flight and before the next ones are posted: a GC pause, a VM migration or a
   debugger does the same at a random point;
3. once resumed (SIGCONT), posts ``--stores`` stores of ``--second`` fresh keys at once (a
   writer frozen inside its store call carries on where it was), waits for every future
   (``RESULT_TIMEOUT_S`` each) and for its tier's in-flight writes to end, disconnects its
   peers and prints ``{"event": "settled", "first": {reason: keys}, "second": {...},
   "unsettled": N, "inflight": N, "seconds": S}`` (``"ok"`` counts the stored keys);
4. waits for ``exit`` on stdin (at most ``--max-seconds``), closes its tier and exits 0.

Any error prints ``{"event": "error", "error": "..."}`` and exits 1. Every wait has a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from torch_kv_tier.benchmarks.options import heartbeat_timeout, size
from torch_kv_tier.cli_numbers import integer, real
from torch_kv_tier.manager import TierManager, TransferResult

RESULT_TIMEOUT_S = 30.0  # one store future after the resume
INFLIGHT_TIMEOUT_S = 15.0  # the transport's writes to end after the futures settled
READY_TIMEOUT_S = 60.0  # the parent's "post" after "ready" (it stops the host first)
FILL = 0xAA  # every byte A ever writes


def _emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _post(tier: TierManager, tag: str, stores: int, per_store: int) -> list[Future[TransferResult]]:
    return [
        tier.store([f"a-{tag}-{s}-{i}" for i in range(per_store)], range(per_store))
        for s in range(stores)
    ]


def _outcomes(futures: list[Future[TransferResult]], deadline: float) -> tuple[Counter[str], int]:
    """Keys per outcome (``"ok"`` or the failure reason) and the futures still unsettled."""
    reasons: Counter[str] = Counter()
    unsettled = 0
    for future in futures:
        try:
            result = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            unsettled += 1
            continue
        reasons["ok"] += len(result.keys)
        reasons.update(result.failed.values())
    return reasons, unsettled


def _read_command(timeout_s: float) -> str | None:
    """The next line on stdin, stripped; ``None`` when none comes within ``timeout_s``."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    return sys.stdin.readline().strip() if ready else None


def run(args: argparse.Namespace) -> None:
    """Steps 1 to 4 of the module docstring."""
    with TierManager.create(
        args.num_blocks, args.block_len, name="frozen-writer", grant_batch=args.grant_batch
    ) as tier:
        tier.arena.tensor.fill_(FILL)
        if args.private:
            peer = tier.connect(
                args.address,
                private=True,
                slots=args.num_blocks,
                heartbeat_timeout_s=args.heartbeat_timeout,
            )
        else:
            peer = tier.connect(args.address, heartbeat_timeout_s=args.heartbeat_timeout)
        warm = tier.store(["a-warm"], [0]).result(timeout=RESULT_TIMEOUT_S)
        if not warm.ok:
            raise RuntimeError(f"warm-up store failed: {warm.failed}")
        _emit("ready")
        if _read_command(READY_TIMEOUT_S) != "post":
            raise RuntimeError(f"no 'post' on stdin within {READY_TIMEOUT_S:.0f} s")
        first = _post(tier, "first", args.stores, args.first)
        stats = tier.stats()
        _emit(
            "posted",
            inflight=stats.inflight,
            queued=stats.queued,
            done=sum(f.done() for f in first),
        )
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until the parent sends SIGCONT
        resumed = time.monotonic()
        second = _post(tier, "second", args.stores, args.second)
        deadline = resumed + RESULT_TIMEOUT_S
        first_reasons, first_unsettled = _outcomes(first, deadline)
        second_reasons, second_unsettled = _outcomes(second, deadline)
        quiet_by = time.monotonic() + INFLIGHT_TIMEOUT_S
        while tier.stats().inflight and time.monotonic() < quiet_by:
            time.sleep(0.01)
        inflight = tier.stats().inflight
        tier.disconnect(peer)  # also when the host was dropped and is being dialled again
        _emit(
            "settled",
            first=dict(first_reasons),
            second=dict(second_reasons),
            unsettled=first_unsettled + second_unsettled,
            inflight=inflight,
            seconds=round(time.monotonic() - resumed, 3),
        )
        _read_command(args.max_seconds)  # "exit", or the parent is gone


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kv_tier.benchmarks.frozen_writer_client")
    parser.add_argument("address", help="HOST:PORT of a torch-kv-tier serve")
    parser.add_argument("--private", action="store_true", help="lease every slot (else: shared)")
    parser.add_argument("--num-blocks", type=integer, default=256, help="arena (and lease) blocks")
    parser.add_argument("--block-len", type=size, default=262144)
    parser.add_argument("--grant-batch", type=integer, default=256, help="shared: slots per grant")
    parser.add_argument("--stores", type=integer, default=4, help="store calls per batch")
    parser.add_argument(
        "--first", type=integer, default=64, help="keys per store before the freeze"
    )
    parser.add_argument("--second", type=integer, default=64, help="keys per store after it")
    parser.add_argument("--heartbeat-timeout", type=heartbeat_timeout, default=2.0, help="s")
    parser.add_argument("--max-seconds", type=real, default=120.0, help="most time to linger")
    args = parser.parse_args(argv)
    try:
        run(args)
    except Exception:
        _emit("error", error=traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
