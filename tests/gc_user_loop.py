"""A user's loop that used to abort in the garbage collector (issue 13); run as a subprocess.

Each cycle: a ``PagedKVOffloader`` on a loopback ``torch-kv-tier serve`` offloads pages, the
server is SIGKILLed, the next restore is posted to it and refused, the offloader is closed and
dropped, and ``gc.collect()`` runs. Prints ``kept=N`` (agents kept alive because a post was
refused) and ``done``; a crash shows in the exit status and faulthandler's traceback.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import sys

import torch

from torch_kv_tier import session_releases
from torch_kv_tier.integrations.torch_loop import PagedKVOffloader, prefix_keys
from torch_kv_tier.remote import client, session_io
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.transport import agent_lifetime

# A tier notices a dead host's closed control connection within milliseconds and then posts
# nothing to it; this loop must post its restore to the dead host (the path that leaked), as a
# tier does when the host dies between its last check and the post. So the sessions here learn
# of the death by heartbeats only.
session_io.disconnected = lambda monitor: False
# Closing the offloader then waits on the dead host twice: its disconnect, and a release of the
# ended session over a session of its own (2 s each, 4 s of each cycle's 6). The host is dead:
# the same calls fail the same way after 0.5 s.
client._DISCONNECT_TIMEOUT_S = 0.5
session_releases._RELEASE_TIMEOUT_S = 0.5

# 8 KiB pages: a 4-page restore is a multi-fragment CMA read, the case that leaked a request
LAYERS, PAGES, PAGE, HEADS, HEAD_DIM = 2, 24, 8, 2, 32


def main(cycles: int) -> None:
    faulthandler.enable()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for cycle in range(cycles):
        shape = (PAGES, PAGE, HEADS, HEAD_DIM)
        keys_c = [torch.randn(shape) for _ in range(LAYERS)]
        values_c = [torch.randn(shape) for _ in range(LAYERS)]
        keys = prefix_keys(range(4 * PAGE), PAGE, namespace=f"cycle-{cycle}".encode())
        block_len = PagedKVOffloader.block_len_for(keys_c, values_c)
        with ServerProcess.start(64, block_len, host="127.0.0.1") as server:
            # A private lease: its restore posts the read straight to the dead host (the path
            # that leaked).
            off = PagedKVOffloader.create(
                keys_c, values_c, remote=server.address, private=True, timeout=10
            )
            assert off.offload([0, 1, 2, 3], keys).result(timeout=30).ok
            server.kill()
            off.restore(keys, [8, 9, 10, 11])
            off.close()
        del off
        gc.collect()
    print(f"kept={agent_lifetime.kept_count()}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
