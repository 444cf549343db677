"""Parse and validate the ``secondary_tiers`` entry of a :class:`RemoteHostTier`.

vLLM hands every key of the entry except ``type``, ``module_path`` and ``backpressure`` to the
tier's constructor. This module turns those keys into a frozen :class:`RemoteHostTierConfig`,
raising ``ValueError`` for bad input before the tier touches memory or the network. It imports
nothing from vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_kv_tier.membership import HostSource, StaticHosts, parse_source, source_scheme
from torch_kv_tier.overdue import TRANSFER_TIMEOUT_S
from torch_kv_tier.remote.client import parse_address
from torch_kv_tier.remote.quantities import CONNECT_TIMEOUT, RECONNECT_INTERVAL, Floor, seconds

logger = logging.getLogger(__name__)

# Keys this tier reads; anything else is accepted (vLLM and other tiers may add keys over time)
# and logged once, so a typo does not pass silently.
KNOWN_KEYS = frozenset(
    {
        "remote",
        "token_file",
        "private",
        "slots",
        "max_inflight",
        "config_fields",
        "backends",
        "num_threads",
        "locality",
        "enable_kv_events",
        "drain_timeout_s",
        "transfer_timeout_s",
        "close_timeout_s",
        "reconnect_interval_s",
        "connect_timeout_s",
        "expected_concurrency",
        "expected_prefix_tokens",
        "promotion_guard_s",
    }
)

_LOCALITIES = ("REMOTE", "LOCAL")


@dataclass(frozen=True)
class RemoteHostTierConfig:
    """Validated options of one :class:`RemoteHostTier`.

    Attributes:
        remote: the ``remote`` setting as written (a static list joined by commas): the
            tier's metric label and what its messages name.
        source: where the ``torch-kv-tier serve`` remote hosts come from: a static list of
            ``HOST:PORT``, DNS (``dns:NAME:PORT``, ``srv:_SERVICE._PROTO.NAME``) or a watched
            file (``file:/PATH``); see :mod:`torch_kv_tier.membership`.
        token: shared secret read from ``token_file`` (``None`` when the server needs none).
        private: lease slots of each remote host for this tier alone (no other tier reads or
            evicts them) instead of joining the host's shared pool, the default, where every
            tier with equal ``config_fields`` finds the chunks the others stored (a prefix one
            vLLM instance computed is a hit for the others: chunks are keyed by vLLM's block
            hashes).
        slots: with ``private``, slots to lease on each remote host; ``None`` leases every
            free slot (up to the server's ``--max-lease``). Without ``private`` it is an error.
        max_inflight: transfers the tier keeps in flight before queueing inside the tier.
        config_fields: model facts hashed into the fingerprint the server checks, which is also
            the tier's namespace in a host's shared pool: tiers of different models that share
            a host must differ here, or they read each other's chunks for equal token
            prefixes. ``None`` derives them from vLLM's offloading config
            (``default_config_fields``: model, KV dtype, tokens per chunk, parallelism, chunk
            bytes), so engines of the same model share and others never do.
        backends: NIXL backends (``None``: UCX).
        num_threads: NIXL's UCX worker threads (0: none; see ``NixlTransport``).
        locality: ``"REMOTE"`` or ``"LOCAL"``, what request tier filters match against.
        enable_kv_events: emit vLLM KV events for chunks stored in and dropped from this tier.
        drain_timeout_s: how long ``drain_jobs`` waits for in-flight transfers before raising.
        transfer_timeout_s: how long one transfer may stay in flight before its host is dropped
            and dialled again (its stores fail; a promotion reading from it stays pending until
            its read is reported, so vLLM never reuses chunks it may still land in); 0 never.
            Raise it over a slow link (``overdue.TRANSFER_TIMEOUT_S``).
        close_timeout_s: how long ``shutdown`` may take (waiting for in-flight transfers, then
            cancelling them, then ending the sessions); default within vLLM's 5 s grace.
        reconnect_interval_s: how often ``source`` is resolved again (hosts that appeared are
            connected, those that vanished disconnected) and a dropped remote host is dialled
            again; 0 never, else at least 0.1 s (``quantities.RECONNECT_INTERVAL``).
        connect_timeout_s: how long one handshake with a remote host may take (and each
            request to it): at least 0.1 s (``quantities.CONNECT_TIMEOUT``).
        expected_concurrency: concurrent requests the startup sizing check
            (:mod:`~torch_kv_tier.integrations.vllm.tier_sizing`) sizes the CPU tier for.
        expected_prefix_tokens: prefix length one request is assumed to promote, by that
            check and by admission's test whether the CPU tier can take every waiting
            request's prefix (:mod:`~torch_kv_tier.integrations.vllm.admission`); ``None``:
            no startup check, and admission uses the longest recent prompt.
        promotion_guard_s: how long a request that would recompute waits while another
            request's promotion is under way, so the promoted request's steps are not filled
            with its prefill (see :mod:`~torch_kv_tier.integrations.vllm.admission`); 0: never.
    """

    remote: str
    source: HostSource
    token: str | None = None
    private: bool = False
    slots: int | None = None
    max_inflight: int = 64
    config_fields: dict[str, Any] | None = None
    backends: tuple[str, ...] | None = None
    num_threads: int = 0
    locality: str = "REMOTE"
    enable_kv_events: bool = False
    drain_timeout_s: float = 120.0
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    close_timeout_s: float = 3.0
    reconnect_interval_s: float = 5.0
    connect_timeout_s: float = 10.0
    expected_concurrency: int = 1
    expected_prefix_tokens: int | None = None
    promotion_guard_s: float = 0.05

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RemoteHostTierConfig:
        """Build the config from the keys of a ``secondary_tiers`` entry.

        Raises:
            ValueError: a key has the wrong type or value, ``remote`` is missing, or
                ``token_file`` cannot be read. The message names the key and what it expects.
        """
        unknown = sorted(set(options) - KNOWN_KEYS)
        if unknown:
            logger.warning(
                "RemoteHostTier ignores unknown config key(s) %s; known keys: %s",
                unknown,
                sorted(KNOWN_KEYS),
            )
        if options.get("remote") is None:
            raise ValueError(
                'RemoteHostTier needs "remote": the HOST:PORT printed by `torch-kv-tier serve` '
                '(its "ready HOST:PORT" line), a list of them, "dns:NAME:PORT", '
                '"srv:_SERVICE._PROTO.NAME" or "file:/PATH"'
            )
        backends = options.get("backends")
        private = _bool(options, "private", cls.private)
        slots = _optional_positive_int(options, "slots")
        if slots is not None and not private:
            raise ValueError(
                'RemoteHostTier "slots" sizes a private lease: add "private": true, or drop '
                '"slots" to share the hosts\' pools with every tier of the same model'
            )
        remote, source = parse_remote(options["remote"])
        return cls(
            remote=remote,
            source=source,
            token=_read_token(options.get("token_file")),
            private=private,
            slots=slots,
            max_inflight=_positive_int(options, "max_inflight", cls.max_inflight),
            config_fields=_config_fields(options.get("config_fields")),
            backends=_backends(backends) if backends is not None else None,
            num_threads=_positive_int(options, "num_threads", cls.num_threads, allow_zero=True),
            locality=_locality(options.get("locality", cls.locality)),
            enable_kv_events=_bool(options, "enable_kv_events", cls.enable_kv_events),
            drain_timeout_s=_seconds(options, "drain_timeout_s", cls.drain_timeout_s),
            transfer_timeout_s=_seconds(
                options, "transfer_timeout_s", cls.transfer_timeout_s, allow_zero=True
            ),
            close_timeout_s=_seconds(options, "close_timeout_s", cls.close_timeout_s),
            reconnect_interval_s=_seconds(
                options,
                "reconnect_interval_s",
                cls.reconnect_interval_s,
                allow_zero=True,
                floor=RECONNECT_INTERVAL,
            ),
            connect_timeout_s=_seconds(
                options, "connect_timeout_s", cls.connect_timeout_s, floor=CONNECT_TIMEOUT
            ),
            expected_concurrency=_positive_int(
                options, "expected_concurrency", cls.expected_concurrency
            ),
            expected_prefix_tokens=_optional_positive_int(options, "expected_prefix_tokens"),
            promotion_guard_s=_seconds(
                options, "promotion_guard_s", cls.promotion_guard_s, allow_zero=True
            ),
        )

    def connect_kwargs(self) -> dict[str, Any]:
        """``TierManager.connect``'s keyword arguments for every remote host of this tier."""
        return {
            "token": self.token,
            "private": self.private,
            "slots": self.slots,
            "timeout_s": self.connect_timeout_s,
        }


def parse_remote(value: Any) -> tuple[str, HostSource]:
    """``remote`` as its label and its host source: a ``dns:``/``srv:``/``file:`` spec
    (:func:`~torch_kv_tier.membership.parse_source`), else a static list (:func:`parse_remotes`).

    Raises ``ValueError`` naming ``remote`` and what it accepts.
    """
    if isinstance(value, str) and source_scheme(value) is not None:
        try:
            return value, parse_source(value)
        except ValueError as exc:
            raise ValueError(f'"remote": {exc}') from None
    remotes = parse_remotes(value)
    return ",".join(remotes), StaticHosts(remotes)


def parse_remotes(value: Any) -> tuple[str, ...]:
    """Normalise ``remote`` (one ``HOST:PORT``, a comma-separated string, or a list).

    Raises ``ValueError`` for an empty value, a duplicate, or an entry that is not
    ``HOST:PORT`` with a port in 1..65535 (IPv6 hosts in brackets: ``[::1]:5555``).
    """
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise ValueError(
            f'"remote" must be "HOST:PORT", a list of them, "dns:NAME:PORT", '
            f'"srv:_SERVICE._PROTO.NAME" or "file:/PATH", got {value!r}'
        )
    if not items:
        raise ValueError('"remote" is empty: give at least one HOST:PORT')
    for item in items:
        try:
            parse_address(item)
        except ValueError:
            raise ValueError(
                f'"remote" entry {item!r} is not HOST:PORT (e.g. 10.0.0.5:5600)'
            ) from None
    duplicates = sorted({item for item in items if items.count(item) > 1})
    if duplicates:
        raise ValueError(f'"remote" lists {duplicates} more than once')
    return tuple(items)


def _read_token(path: Any) -> str | None:
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ValueError(f'"token_file" must be a file path, got {path!r}')
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ValueError(f'"token_file" {path!r} cannot be read: {exc}') from exc
    if not token:
        raise ValueError(f'"token_file" {path!r} is empty; put the server\'s token in it')
    return token


def _positive_int(
    options: Mapping[str, Any], key: str, default: int, *, allow_zero: bool = False
) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        kind = "an integer >= 0" if allow_zero else "a positive integer"
        raise ValueError(f'"{key}" must be {kind}, got {value!r}')
    return value


def _optional_positive_int(options: Mapping[str, Any], key: str) -> int | None:
    if options.get(key) is None:
        return None
    return _positive_int(options, key, 0)


def _seconds(
    options: Mapping[str, Any],
    key: str,
    default: float,
    *,
    allow_zero: bool = False,
    floor: Floor | None = None,
) -> float:
    """``quantities.seconds`` of ``key``'s value, every problem a ``ValueError`` naming it."""
    try:
        return seconds(f'"{key}"', options.get(key, default), zero=allow_zero, floor=floor)
    except TypeError as exc:  # (a str, a bool...): a config's errors are all ValueErrors
        raise ValueError(str(exc)) from None


def _bool(options: Mapping[str, Any], key: str, default: bool) -> bool:
    value = options.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f'"{key}" must be true or false, got {value!r}')
    return value


def _config_fields(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            f'"config_fields" must be a JSON object, the same one passed to '
            f"`torch-kv-tier serve --config-fields`, got {value!r}"
        )
    return dict(value)


def _backends(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f'"backends" must be a non-empty list of NIXL backend names, got {value!r}'
        )
    return tuple(value)


def _locality(value: Any) -> str:
    if not isinstance(value, str) or value.upper() not in _LOCALITIES:
        raise ValueError(f'"locality" must be one of {_LOCALITIES}, got {value!r}')
    return value.upper()


def default_config_fields(spec: Any, chunk_bytes: int) -> dict[str, Any]:
    """The namespace of a tier whose config sets no ``config_fields``: what makes the bytes
    under one of vLLM's block hashes differ from engine to engine (the model, its KV dtype, how
    many tokens a chunk holds, the parallel layout, the chunk's size). Reads vLLM's
    ``OffloadingConfig`` (0.32 and 0.33 carry these fields); a missing one is left out."""
    config = getattr(spec, "config", None)
    model = getattr(config, "model", None)
    cache = getattr(config, "cache", None)
    parallel = getattr(config, "parallel", None)
    fields: dict[str, Any] = {
        "model": getattr(model, "name", None),
        "kv_dtype": getattr(model, "dtype", None),
        "tokens_per_hash": getattr(cache, "tokens_per_hash", None),
        "blocks_per_chunk": getattr(cache, "blocks_per_chunk", None),
        "tp_size": getattr(parallel, "tp_size", None),
        "pp_size": getattr(parallel, "pp_size", None),
        "chunk_bytes": chunk_bytes,
    }
    return {key: str(value) for key, value in fields.items() if value is not None}
