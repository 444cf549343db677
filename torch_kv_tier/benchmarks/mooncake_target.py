"""Mooncake's target for ``mooncake_tcp``: ``python -m torch_kv_tier.benchmarks.mooncake_target
BYTES``.

Allocates a zeroed pool of BYTES, registers it with a TransferEngine (TCP, P2P handshake),
prints ``ready HOST:PORT BASE_ADDR`` on stdout and serves until its stdin closes. Imports only
numpy and Mooncake, so it starts in well under a second.
"""

from __future__ import annotations

import os
import sys


def serve(nbytes: int) -> int:
    """Serve a pool of ``nbytes`` until stdin reaches end of file; the exit status."""
    import numpy as np

    os.environ.setdefault("GLOG_minloglevel", "1")  # no INFO line per batch transfer
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        print("error initialize", flush=True)
        return 1
    pool = np.zeros(nbytes, dtype=np.uint8)
    addr = int(pool.ctypes.data)
    if engine.register_memory(addr, nbytes) != 0:
        print("error register_memory", flush=True)
        return 1
    print(f"ready 127.0.0.1:{engine.get_rpc_port()} {addr}", flush=True)
    sys.stdin.read()  # the parent closes stdin (or kills us)
    engine.unregister_memory(addr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m torch_kv_tier.benchmarks.mooncake_target BYTES")
    sys.exit(serve(int(sys.argv[1])))
