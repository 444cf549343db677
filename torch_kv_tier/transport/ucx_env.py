"""UCX environment policy applied before the first NIXL agent exists.

The NIXL wheel bundles UCX with its InfiniBand module (``ib``). On machines without an RDMA
device that module only crashes the process at exit (a segfault in the bundled libnl-route's exit
handler, so even a successful run exits 139). Machines with an RDMA device need the module for
real one-sided transfers. So: exclude ``ib`` only when no RDMA device exists and the user has not
set ``UCX_MODULES`` themselves.

``UCX_TCP_USER_TIMEOUT`` is left to the user (README, "An interface that vanishes"). UCX wires
a TCP lane on every interface it saw when the agent was created; when one of them vanishes (a
veth or VPN interface removed, a NIC unplugged), a transfer striped onto its lane waits for an
acknowledgement that never comes, without error, for the kernel's retransmission timeout
(``tcp_retries2``: about 15 minutes), and a redial of that host gets the same NIXL remote agent
back, stalled lane and all (``tests/test_vanished_interface.py``). A bound (``30s``) on a tier
makes TCP close such a socket: UCX fails the endpoint, the tier drops the host and its redial
builds a new endpoint on the interfaces that remain. It is not set by default because it also
cuts a peer frozen with data waiting for it (a zero window counts against it on Linux 5.11 and
later), and that cut is one more connection failure that meets UCX's use-after-free over TCP
(README, "Known upstream issue"): a tier whose frozen host resumed within about 0.1 s of the cut
crashed in 9 of 12 runs, and a host that cut a tier frozen with loads in flight died in 4 of 4
under ``MALLOC_PERTURB_``. Without the bound, a stalled transfer still settles its future at
``transfer_timeout_s`` and no byte is wrong; the host is unusable until the kernel gives up.
``tests/test_frozen_peer_bound.py`` checks a tier with the bound against a frozen host.

The UCX backend itself is created with ``ucx_backend_params``: never split a transfer across its
worker threads, and on GPU hosts leave out UCX's ``rc_gda`` transports.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_RDMA_SYSFS = Path("/sys/class/infiniband")
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def _lists_any(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def has_rdma_device(sysfs: Path = _RDMA_SYSFS) -> bool:
    """True when the kernel exposes at least one RDMA device."""
    return _lists_any(sysfs)


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
