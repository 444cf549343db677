"""``torch-kv-tier serve``'s settings: the command line, its validation and ``ServerConfig``.

Pure functions of their input (files are read for ``--token-file`` only); every problem is a
``ValueError`` naming the option and what it expects, raised before anything is allocated or
bound.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from torch_kv_tier.cli_numbers import integer, real
from torch_kv_tier.remote.quantities import BYTES_EXAMPLES, Floor, byte_count, count, port, seconds

logger = logging.getLogger(__name__)

MAX_POOL_BYTES = 2**62  # more than any machine holds (numpy refuses a pool past 2**63 bytes)
# The shortest --lease-timeout and --hold-timeout (``ServerConfig._check_quantities``).
MIN_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``Server`` needs; ``from_args`` builds it from the command line."""

    num_blocks: int
    block_len: int
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    config_fields: dict[str, Any] | None = None
    metrics_port: int | None = None
    lease_timeout_s: float = 30.0
    max_lease: int | None = None
    namespace_quota: int | None = None
    max_grant: int | None = None
    max_sessions: int = 1024
    hold_timeout_s: float | None = None  # held slots go back after this; None: when released
    host_id: str | None = None  # default: the address the server listens on
    disk_paths: tuple[str, ...] = ()  # directories of the disk tier (``--disk``)
    disk_bytes: int = 0  # bytes of blocks per directory (``--disk-bytes``)
    disk_admit: int = 2  # sightings before a block is copied to disk (``--disk-admit``)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_quantities()
        if self.num_blocks * self.block_len > MAX_POOL_BYTES:
            raise ValueError(
                f"--num-blocks x --block-len is {self.num_blocks * self.block_len} bytes, more "
                f"than {MAX_POOL_BYTES} (no machine holds such a pool): pass a --num-blocks "
                "that fits this host's memory"
            )
        if self.max_lease is not None and not 0 < self.max_lease <= self.num_blocks:
            raise ValueError(f"--max-lease must be in [1, --num-blocks], got {self.max_lease}")
        if self.namespace_quota is not None and not 0 < self.namespace_quota <= self.num_blocks:
            raise ValueError(
                f"--namespace-quota must be in [1, --num-blocks], got {self.namespace_quota}"
            )
        if self.max_grant is not None and not 0 < self.max_grant <= self.num_blocks:
            raise ValueError(f"--max-grant must be in [1, --num-blocks], got {self.max_grant}")
        if self.host_id is not None and not 0 < len(self.host_id) <= 128:
            raise ValueError(f"--host-id must be 1 to 128 characters, got {self.host_id!r}")
        if self.disk_paths and not self.disk_bytes:
            raise ValueError(
                "--disk needs --disk-bytes N: the bytes of blocks each directory holds "
                "(e.g. 64G, 512MiB)"
            )
        if self.disk_paths:  # 8192.5 and 10**30 failed at start, after the pool and a file
            object.__setattr__(self, "disk_bytes", count("--disk-bytes", self.disk_bytes))
        if self.disk_paths and self.disk_bytes < self.block_len:
            raise ValueError(
                f"--disk-bytes must hold at least one block of --block-len {self.block_len} "
                f"bytes, got {self.disk_bytes}"
            )
        if self.disk_bytes and not self.disk_paths:
            raise ValueError("--disk-bytes needs --disk PATH (a directory for the blocks)")
        if len(set(self.disk_paths)) != len(self.disk_paths):
            raise ValueError(f"--disk names a directory twice: {list(self.disk_paths)}")
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without a token: anyone who reaches that "
                "address could read and overwrite the pool. Pass --token-file PATH (clients "
                "use the same token), or listen on 127.0.0.1"
            )

    def _check_types(self) -> None:
        """``TypeError`` naming the field (and its option) for a value of another type than it
        declares: ``token=5`` was taken and failed each client's handshake, ``host_id=5`` raised
        ``len()``'s error, naming nothing. ``disk_paths`` takes any sequence of paths (a list, or
        ``os.PathLike`` entries), stored as the tuple of ``str`` it declares; one ``str`` is
        refused (it is no list of directories). ``ValueError`` for an empty ``token``."""
        for field, option, example in _STRS:
            value = getattr(self, field)
            if not isinstance(value, str) and (value is not None or field == "host"):
                _wrong_type(field, option, value, "a str", f"{field}={example}")
        if self.token == "":
            raise ValueError("token must not be empty: pass a long random string (--token-file)")
        if self.config_fields is not None and not isinstance(self.config_fields, dict):
            example = 'config_fields={"model": "m"}'
            _wrong_type("config_fields", "--config-fields", self.config_fields, "a dict", example)
        paths = self.disk_paths
        if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
            _wrong_type("disk_paths", "--disk", paths, "a list or tuple", _DISKS)
        if not all(isinstance(path, (str, os.PathLike)) for path in paths):
            _wrong_type("disk_paths", "--disk", paths, "paths (str or os.PathLike)", _DISKS)
        object.__setattr__(self, "disk_paths", tuple(os.fspath(path) for path in paths))

    def _check_quantities(self) -> None:
        """Every duration (``quantities.seconds``: finite, > 0, at most ``MAX_WAIT_S``: nan
        passed ``<= 0`` and a session silent for nan seconds never expired; ``1e300`` was taken)
        and every count (``quantities.count``), stored as the plain ``float``/``int`` the wire
        carries: a ``numpy.float32`` lease timeout stopped the host's loop at its first
        ``Accept``, which could not encode it. ``TypeError``/``ValueError`` naming the option.

        A timeout is at least ``MIN_TIMEOUT_S``: a tier heartbeats every third of the lease
        timeout (its 1 s period, shortened), and the host polls and checks expiries every
        0.1 s and counts a silence of a third of either timeout as its own stall. At 0.001 s
        each session's tier sent 3000 heartbeats a second (15% of a core), a tier paused for
        0.1 s (a collection, a loaded machine) lost its session, and held slots went back
        before their tier could notice the loss and release them.

        The ports (``quantities.port``): ``port=1.5`` listened on port 1 (ZeroMQ read
        ``tcp://127.0.0.1:1.5``), ``port=True`` and ``metrics_port=1.5`` failed as they bound."""
        for option, field in _SECONDS:
            value = getattr(self, field)
            if value is not None or field == "lease_timeout_s":
                floor = Floor(MIN_TIMEOUT_S, _TOO_SHORT[option])
                object.__setattr__(self, field, seconds(option, value, floor=floor))
        object.__setattr__(self, "port", port("--port", self.port))
        if self.metrics_port is not None:
            object.__setattr__(self, "metrics_port", port("--metrics-port", self.metrics_port))
        for option, field in _COUNTS:
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, count(option, value))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """Validate the parsed command line; ``ValueError`` says which option is wrong."""
        return cls(
            num_blocks=args.num_blocks,
            block_len=byte_count("--block-len", args.block_len),
            host=args.host,
            port=args.port,
            token=read_token_file(args.token_file) if args.token_file else None,
            config_fields=parse_config_fields(args.config_fields),
            metrics_port=args.metrics_port,
            lease_timeout_s=args.lease_timeout,
            max_lease=args.max_lease,
            namespace_quota=args.namespace_quota,
            max_grant=args.max_grant,
            max_sessions=args.max_sessions,
            hold_timeout_s=args.hold_timeout,
            host_id=args.host_id,
            disk_paths=tuple(args.disk or ()),
            disk_bytes=0
            if args.disk_bytes is None
            else byte_count("--disk-bytes", args.disk_bytes),
            disk_admit=args.disk_admit,
        )


def _wrong_type(field: str, option: str, value: object, expected: str, example: str) -> NoReturn:
    """Raise the ``TypeError`` saying ``field`` (``option``) must be ``expected``."""
    raise TypeError(
        f"ServerConfig field {field} ({option}) must be {expected}, got {value!r} "
        f"(a {type(value).__name__}): pass e.g. {example}"
    )


_DISKS = "disk_paths=('/mnt/nvme0', '/mnt/nvme1')"
# (field, option, example) of every ``str`` field ``_check_types`` checks
_STRS = (
    ("host", "--host", "'127.0.0.1'"),
    ("token", "--token-file", "open(path).read().strip()"),
    ("host_id", "--host-id", "'rack1-a'"),
)
# (option, field) of every duration and count ``_check_quantities`` checks
_SECONDS = (("--lease-timeout", "lease_timeout_s"), ("--hold-timeout", "hold_timeout_s"))
_TOO_SHORT = {  # why, and what to pass instead
    "--lease-timeout": "tiers heartbeat every third of it, and one paused longer than it loses "
    "its session; pass 30 (the default), or a few seconds at the least",
    "--hold-timeout": "a tier notices its session ended only after its heartbeat timeout (10 s "
    "by default), then releases its slots; pass that or more",
}
_COUNTS = (
    ("--num-blocks", "num_blocks"),
    ("--block-len", "block_len"),
    ("--max-lease", "max_lease"),
    ("--namespace-quota", "namespace_quota"),
    ("--max-grant", "max_grant"),
    ("--max-sessions", "max_sessions"),
    ("--disk-admit", "disk_admit"),
)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped); ``ValueError`` if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
            mode = os.fstat(f.fileno()).st_mode
    except OSError as exc:
        raise ValueError(f"cannot read --token-file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:  # a ValueError, but its text names no option
        raise ValueError(
            f"--token-file {path} is not UTF-8 text: put a long random string in it "
            "(openssl rand -hex 32)"
        ) from None
    if not token:
        raise ValueError(f"--token-file {path} is empty: put a long random string in it")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("token file %s is readable by other users: chmod 600 it", path)
    return token


def parse_config_fields(text: str | None) -> dict[str, Any] | None:
    """``--config-fields`` JSON (an object) or ``None``; ``ValueError`` if it is not an object."""
    if text is None:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config-fields is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--config-fields must be a JSON object, got {type(fields).__name__}")
    return fields


def format_address(host: str, port: int) -> str:
    """``HOST:PORT``, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options."""
    parser.add_argument(
        "--num-blocks", type=integer, required=True, help="slots in the pool (required)"
    )
    parser.add_argument(
        "--block-len",
        required=True,
        help=f"bytes per block, e.g. 65536 or 64K (every size option takes {BYTES_EXAMPLES}); "
        "clients must match (required)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1); anything else requires --token-file",
    )
    parser.add_argument(
        "--port", type=integer, default=0, help="control port (default 0: any free port)"
    )
    parser.add_argument(
        "--token-file",
        help="file holding the shared secret clients must prove they know (default: none, "
        "no token, which only a loopback --host allows)",
    )
    parser.add_argument(
        "--config-fields",
        help="JSON object of model config values; clients with a different non-empty "
        "fingerprint are rejected (default: none, every model is served, each in its own "
        "namespace)",
    )
    parser.add_argument(
        "--metrics-port",
        type=integer,
        help="serve Prometheus text on http://HOST:PORT/metrics (default: no metrics served)",
    )
    parser.add_argument(
        "--lease-timeout",
        type=real,
        default=30.0,
        help="seconds without a heartbeat before a client's session ends (default 30, at "
        "least 1: tiers heartbeat every second, or every third of it if that is shorter); the "
        "slots it may still write stay held "
        "until the client releases them",
    )
    parser.add_argument(
        "--max-lease",
        type=integer,
        help="most slots one private client may lease (default: the whole pool)",
    )
    parser.add_argument(
        "--namespace-quota",
        type=integer,
        help="most slots the shared sessions of one config fingerprint may fill; a namespace "
        "at its quota evicts its own keys (default: the whole pool)",
    )
    parser.add_argument(
        "--max-grant",
        type=integer,
        help="most free slots one shared client may hold for its next writes (default: "
        "a sixteenth of the pool, at most 4096)",
    )
    parser.add_argument(
        "--hold-timeout",
        type=real,
        help="seconds after which slots held for an ended session go back to the pool even if "
        "its client never released them (default: never; at least 1, and best the tiers' "
        "heartbeat timeout, 10 s by default, or more). Loads still verify their bytes, so "
        "a late write costs a miss, not wrong bytes; only private tiers built with "
        "verify=False then rely on the writer having stopped by that time",
    )
    parser.add_argument(
        "--max-sessions",
        type=integer,
        default=1024,
        help="most sessions open at once (default 1024); more handshakes are rejected",
    )
    parser.add_argument(
        "--disk",
        action="append",
        metavar="PATH",
        help="a directory for a disk tier behind the pool (repeat for several disks): blocks "
        "the pool evicts are kept there and promoted back when a tier asks; a restart on the "
        "same directories finds them again (default: none, the pool alone)",
    )
    parser.add_argument(
        "--disk-bytes",
        help="bytes of blocks per --disk directory, allocated at start, e.g. 64G (no "
        "default: --disk needs it)",
    )
    parser.add_argument(
        "--disk-admit",
        type=integer,
        default=2,
        help="times a block must be seen (stored, stored again, loaded) before it is copied to "
        "disk (default 2: blocks stored once and never read stay off the disk; 1: every block)",
    )
    parser.add_argument(
        "--host-id",
        help="this host's stable name, which tiers place keys by (default: HOST:PORT as it "
        "listens); give a restarted or moved host the same one",
    )
