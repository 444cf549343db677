"""Remote host: ``torch-kv-tier serve`` (a NIXL-registered DRAM pool) and its control plane.

``RemoteSession`` is the client side of the handshake and lease; ``ServerProcess`` runs a
server as a child process.
"""

from torch_kv_tier.remote.client import HandshakeRejected, RemoteSession, parse_address
from torch_kv_tier.remote.host_names import UnresolvedHost
from torch_kv_tier.remote.launch import ServerProcess
from torch_kv_tier.remote.protocol import PROTOCOL_VERSION, Region

__all__ = [
    "PROTOCOL_VERSION",
    "HandshakeRejected",
    "Region",
    "RemoteSession",
    "ServerProcess",
    "UnresolvedHost",
    "parse_address",
]
