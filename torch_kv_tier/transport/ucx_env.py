"""UCX environment policy applied before the first NIXL agent exists.

The NIXL wheel bundles UCX with its InfiniBand module (``ib``). On machines without an RDMA
device that module only crashes the process at exit (a segfault in the bundled libnl-route's exit
handler, so even a successful run exits 139). Machines with an RDMA device need the module for
real one-sided transfers. So: exclude ``ib`` only when no RDMA device exists and the user has not
set ``UCX_MODULES`` themselves.

UCX's TCP connections get a bound on unacknowledged data (``UCX_TCP_USER_TIMEOUT``, unless the
user set it). UCX wires a TCP lane on every interface it saw when the agent was created; when
one of them vanishes (a veth or VPN interface removed, a NIC unplugged), a transfer striped onto
its lane waits for an acknowledgement that never comes, without error, for the kernel's whole
retransmission timeout (``tcp_retries2``: about 15 minutes). Worse, the tier's redial of that
host (same process, same metadata) gets the same NIXL remote agent back, stalled lane and all:
the host stayed unusable until the kernel gave up. With the bound, TCP closes such a socket,
UCX fails its endpoint (``NIXL_ERR_REMOTE_DISCONNECT``), the tier drops the host, and its redial
builds a new endpoint on the interfaces that remain. A peer that is slow but alive keeps
acknowledging (zero-window probes included), so the bound never cuts it.

The UCX backend itself is created with ``ucx_backend_params``: never split a transfer across its
worker threads, and on GPU hosts leave out UCX's ``rc_gda`` transports.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_RDMA_SYSFS = Path("/sys/class/infiniband")

TCP_USER_TIMEOUT_S = 30
"""``UCX_TCP_USER_TIMEOUT`` in seconds (module doc): half the tier's default ``transfer_timeout_s``,
so a dead lane fails its endpoint before the tier's own bound drops the host, and long enough
that a network blip TCP would ride out does not cost a host its keys."""
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def _lists_any(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def has_rdma_device(sysfs: Path = _RDMA_SYSFS) -> bool:
    """True when the kernel exposes at least one RDMA device."""
    return _lists_any(sysfs)


def _may_use_tcp(tls: str | None) -> bool:
    """Whether a ``UCX_TLS`` value leaves UCX's TCP transport in: unset, ``all``, a list naming
    ``tcp``, or an exclusion list (``^...``) that does not."""
    if tls is None:
        return True
    names = {name.strip() for name in tls.removeprefix("^").split(",")}
    return ("tcp" not in names) if tls.startswith("^") else bool(names & {"tcp", "all"})


def apply_ucx_policy(environ: dict[str, str] | None = None, sysfs: Path = _RDMA_SYSFS) -> None:
    """Set ``UCX_TCP_USER_TIMEOUT`` (``TCP_USER_TIMEOUT_S``) when unset and ``UCX_TLS`` leaves
    TCP in, and ``UCX_MODULES=^ib`` when there is no RDMA device and ``UCX_MODULES`` is unset
    (module doc).

    Must run before UCX is loaded (the first NIXL agent); later calls change nothing that UCX
    has already read. A variable the user set (even empty) always wins.
    """
    env = os.environ if environ is None else environ
    if _may_use_tcp(env.get("UCX_TLS")):  # else UCX warns that the variable is unused
        env.setdefault("UCX_TCP_USER_TIMEOUT", f"{TCP_USER_TIMEOUT_S}s")
    if "UCX_MODULES" in env or has_rdma_device(sysfs):
        return
    env["UCX_MODULES"] = "^ib"
    logger.info("no RDMA device found: set UCX_MODULES=^ib (set UCX_MODULES to override)")


def has_gpu_device(procfs: Path = _NVIDIA_GPUS) -> bool:
    """True when the NVIDIA driver lists at least one GPU (no CUDA context is created)."""
    return _lists_any(procfs)


# Above any transfer's descriptor count: NIXL's UCX backend then never splits one (see below).
NO_SPLIT = str(2**31 - 1)


def ucx_backend_params(num_threads: int, procfs: Path = _NVIDIA_GPUS) -> dict[str, str]:
    """Init params of the UCX backend the tier's agents create.

    - ``num_threads``: NIXL's worker threads, as ``nixl_agent_config(num_threads=...)`` would set
      (none by default, ``NixlTransport``).
    - ``split_batch_size``: ``NO_SPLIT``, with worker threads. With them, NIXL splits a
      transfer of 1,024 descriptors or more across them, and when one part fails it completes
      the others with the error while their requests still run
      (``nixlUcxChunkBackendReqH::status``, which only releases them; UCX cannot cancel an RMA).
      A failed read could then land in blocks its caller already reused, so the tier posts
      every transfer whole: a failure it reports is over (the fault model in ``faults.py``).
      Cost: measured in README's transport section.
    - ``engine_config`` on GPU hosts, as vLLM 0.33 does for its transport: ``TLS=^rc_gda``. The
      tier's transfers are posted by the CPU (from host memory, or from a CUDA arena), never by
      GPU kernels, but on a GPU host UCX also wires ``rc_gda`` (GPU-initiated RDMA) lanes to
      every peer, and their connect fails after a delay once a peer stalls or is replaced,
      leaving that peer unreachable until restart. ``UCX_TLS`` set by the user still wins.
    """
    params: dict[str, str] = {}
    if num_threads > 0:
        params["num_threads"] = str(num_threads)
        params["split_batch_size"] = NO_SPLIT
    if has_gpu_device(procfs):
        params["engine_config"] = "TLS=^rc_gda"
    return params
