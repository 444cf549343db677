"""UCX environment policy applied before the first NIXL agent exists.

The NIXL wheel bundles UCX with its InfiniBand module (``ib``). On machines without an RDMA
device that module only crashes the process at exit (a segfault in the bundled libnl-route's exit
handler, so even a successful run exits 139). Machines with an RDMA device need the module for
real one-sided transfers. So: exclude ``ib`` only when no RDMA device exists and the user has not
set ``UCX_MODULES`` themselves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_RDMA_SYSFS = Path("/sys/class/infiniband")


def has_rdma_device(sysfs: Path = _RDMA_SYSFS) -> bool:
    """True when the kernel exposes at least one RDMA device."""
    try:
        return any(sysfs.iterdir())
    except OSError:
        return False


def apply_ucx_policy(environ: dict[str, str] | None = None, sysfs: Path = _RDMA_SYSFS) -> None:
    """Set ``UCX_MODULES=^ib`` when there is no RDMA device and ``UCX_MODULES`` is unset.

    Must run before UCX is loaded (the first NIXL agent); later calls change nothing that UCX
    has already read. An explicit ``UCX_MODULES`` (even empty) always wins.
    """
    env = os.environ if environ is None else environ
    if "UCX_MODULES" in env or has_rdma_device(sysfs):
        return
    env["UCX_MODULES"] = "^ib"
    logger.info("no RDMA device found: set UCX_MODULES=^ib (set UCX_MODULES to override)")
