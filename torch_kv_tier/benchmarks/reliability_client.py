"""A client process for the client-death scenario: lease a whole pool and stream stores.

``python -m torch_kv_tier.benchmarks.reliability_client HOST:PORT`` prints ``connected N`` (the
slots it leased), then ``stored N`` every few batches, until it is killed or ``--max-seconds`` pass
(so it never outlives a parent that forgot it). Keys are never reused, so the stream keeps evicting.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from torch_kv_tier.benchmarks.options import size
from torch_kv_tier.cli_numbers import integer, real
from torch_kv_tier.manager import TierManager, TransferResult


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kv_tier.benchmarks.reliability_client")
    parser.add_argument("address", help="HOST:PORT of a torch-kv-tier serve")
    parser.add_argument("--block-len", type=size, default=4096)
    parser.add_argument("--batch", type=integer, default=8, help="keys per store call")
    parser.add_argument("--window", type=integer, default=8, help="store calls kept in flight")
    parser.add_argument("--max-seconds", type=real, default=120.0)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.max_seconds
    with TierManager.create(args.batch, args.block_len, name="streaming-client") as tier:
        tier.arena.tensor.random_(0, 256)
        peer = tier.connect(args.address, private=True)
        print(f"connected {tier.stats().peers[peer].capacity}", flush=True)
        window: deque[Future[TransferResult]] = deque()
        stored = 0
        batch = 0
        while time.monotonic() < deadline:
            keys = [f"stream-{batch}-{i}" for i in range(args.batch)]
            window.append(tier.store(keys, range(args.batch)))
            batch += 1
            if len(window) >= args.window:
                result = window.popleft().result(timeout=30)
                if not result.ok:
                    print(f"failed {result.failed}", flush=True)
                    return 1
                stored += len(result.keys)
                print(f"stored {stored}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
