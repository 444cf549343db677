"""The checks of the numbers users pass: ``seconds`` for every timeout and duration, ``count``
for a number of slots, blocks or bytes, ``port`` for a TCP port (and ``flag`` for a switch);
``byte_count`` reads every byte-size option of every command (``64K``, ``1.5G``).
Each returns the plain ``float``/``int`` the waits, sockets and the protocol take (numpy's
numbers included) or raises ``TypeError``/``ValueError`` naming the parameter, before the
caller allocates, dials or starts anything. A duration below which the thing it times cannot
work takes a ``Floor``: the tier's (``CONNECT_TIMEOUT``, ``HEARTBEAT_TIMEOUT``,
``HEARTBEAT_INTERVAL``, ``RECONNECT_INTERVAL``, ``DNS_LIFETIME``) are here, with why each is the
least a user should pass. Pure functions."""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction

MAX_WAIT_S = 1e6  # the longest timeout a session takes (every wait has one; a poll's is int ms)
MAX_COUNT = 2**63 - 1  # the largest count the protocol carries (msgpack takes no more)
MAX_PORT = 65535


@dataclass(frozen=True)
class Floor:
    """The shortest duration a parameter takes (``least_s``), and ``why``: what goes wrong
    below it and what to pass instead (the ``ValueError``'s last words)."""

    least_s: float
    why: str


# The tier's floors (measured on loopback, 2 cores): below one, with no fault, the tier fails
# (CONNECT_TIMEOUT, HEARTBEAT_TIMEOUT; DNS_LIFETIME bounds round trips as a handshake's does)
# or loads its hosts and DNS for nothing (the intervals).
CONNECT_TIMEOUT = Floor(
    0.1,
    "a handshake takes round trips (and a token's proof) that a loaded machine or a network "
    "stretches past it (on loopback 6 of 10 connects failed at 0.005 s), and a host that misses "
    "it is reported not ready and never joins; it also bounds each request to the host; pass 10 "
    "(the default), or a few seconds for a host known to be near",
)
HEARTBEAT_TIMEOUT = Floor(
    1.0,
    "a session whose host does not answer a heartbeat within it is lost, so a tier or host "
    "paused that long (a collection, a loaded machine) loses its sessions (at 0.01 s one was "
    "lost at once); pass 10 (the default), or a few seconds at the least",
)
HEARTBEAT_INTERVAL = Floor(
    0.01,
    "each heartbeat is a message the host's one loop answers, and beating more often finds no "
    "loss sooner (a session is lost after heartbeat_timeout_s, at least 1 s, unanswered): "
    "below it the tier only loads its hosts; pass 1 (the default)",
)
RECONNECT_INTERVAL = Floor(
    0.1,
    "each round resolves the host list again (a DNS or SRV query, or a file read) and dials "
    "the hosts that are down, so a shorter one repeats them back to back; pass 5 (the default)",
)
DNS_LIFETIME = Floor(
    0.1,
    "one resolve's queries (A and AAAA, or SRV and each target's) share it, each a round trip "
    "to the nameserver that a loaded machine or a network stretches past it, and a resolve "
    "that times out keeps the hosts known before (none at startup); pass 5 (the default), or "
    "a second for a nameserver known to be near",
)


def seconds(name: str, value: object, *, zero: bool = False, floor: Floor | None = None) -> float:
    """``value``, parameter ``name``'s number of seconds, as the ``float`` every wait takes (a
    ``numpy.float32`` reaches none: Python's waits refuse it). ``TypeError`` unless it is an int
    or a float, numpy's too (not a ``bool``, a ``str``, a ``Fraction`` or a ``Decimal``);
    ``ValueError`` unless it is finite, > 0 (``zero``: >= 0) and at most ``MAX_WAIT_S``, and
    (``floor``) at least ``floor.least_s`` (``zero``: or 0, which turns the thing off)."""
    floating = isinstance(value, numbers.Real) and not isinstance(value, numbers.Rational)
    if isinstance(value, bool) or not (floating or isinstance(value, numbers.Integral)):
        raise TypeError(
            f"{name} must be a number of seconds (an int or a float), got {value!r} "
            f"(a {type(value).__name__}): pass e.g. {name}=10.0, or float() of it"
        )
    try:
        as_float = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int past any float
        as_float = math.inf
    least = (zero and as_float == 0) or (
        as_float >= floor.least_s if floor is not None else as_float >= 0 if zero else as_float > 0
    )
    if not least or not as_float <= MAX_WAIT_S:  # nan fails both
        why = f": {floor.why}" if floor is not None and as_float < floor.least_s else ""
        raise ValueError(f"{name} must be {_bounds(zero, floor)}, got {value}{why}")
    return as_float


def _bounds(zero: bool, floor: Floor | None) -> str:
    """The range ``seconds`` takes, in words: its real lower bound (the floor's, when one is
    given) and ``MAX_WAIT_S``."""
    if floor is None:
        lower = ">= 0" if zero else "> 0"
    else:
        lower = f"at least {floor.least_s:g} s" + (" (or 0: off)" if zero else "")
    return f"{lower} and at most {MAX_WAIT_S:g} s"


def count(name: str, value: object) -> int:
    """``value``, parameter ``name``'s count, as the ``int`` the protocol carries (it cannot
    encode a ``numpy.int64``). ``TypeError`` unless it is an int, numpy's too (not a ``bool``,
    a ``float`` or a ``str``); ``ValueError`` unless it is > 0 and at most ``MAX_COUNT``."""
    number = _int(name, value, "a whole number (an int)", f"{name}=64, or int() of it")
    if not 1 <= number <= MAX_COUNT:
        raise ValueError(f"{name} must be > 0 and at most {MAX_COUNT}, got {value}")
    return number


def ascii_number(text: str) -> str:
    """``text``, a number as typed, if it has no character past ASCII and no ``_``;
    ``ValueError`` otherwise. ``int()`` and ``float()`` take digits of every script and ``_``
    between digits (``６４``, ``٦٤`` and ``6_4`` are 64): an option refuses them instead, as
    ``byte_count`` does."""
    if not text.isascii() or "_" in text:
        raise ValueError(f"not a number in ASCII digits 0-9: {text!r}")
    return text


# a byte size as every command's options take it: a number, then K, M, G or T (powers of 1024)
# with an optional "B" or "iB", in any case
_BYTES = re.compile(
    r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d{1,4}))?\s*([kmgt]?)(?:i?b)?\s*", re.I | re.ASCII
)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
BYTES_EXAMPLES = "4096, 64K, 512MiB or 1.5G; K, M, G and T are powers of 1024"


def byte_count(name: str, text: str) -> int:
    r"""``text``, option ``name``'s size in bytes: a number with an optional suffix K, M, G or
    T (``KiB``/``KB``, any case: powers of 1024), e.g. ``4096``, ``64K``, ``512MiB``,
    ``1.5G``. ``ValueError`` naming ``name`` and ``BYTES_EXAMPLES`` unless it is a whole
    number of bytes > 0 and at most ``MAX_COUNT`` (``nan``, ``-1``, ``1/2``, ``0.3`` are not,
    nor digits past ASCII: ``６４K``, which ``\d`` took)."""
    match = _BYTES.fullmatch(text)
    value = Fraction(0)
    if match is not None:
        number, exponent, unit = match.groups()
        # (a number of over 4300 digits: int()'s limit, whose message names no option)
        with contextlib.suppress(ValueError):
            value = Fraction(number) * Fraction(10) ** int(exponent or 0) * _UNITS[unit.lower()]
    if value.denominator != 1 or not 1 <= value <= MAX_COUNT:
        raise ValueError(
            f"{name} is not a byte count > 0: {text!r} (a whole number of bytes in ASCII digits "
            f"0-9, at most "
            f"{MAX_COUNT}; pass e.g. {BYTES_EXAMPLES})"
        )
    return int(value)


def port(name: str, value: object) -> int:
    """``value``, parameter ``name``'s TCP port, as an ``int`` (0: any free port). ``TypeError``
    unless it is an int, numpy's too (not a ``bool`` or a ``float``, which ``serve`` took and
    bound wrongly or failed to bind); ``ValueError`` unless it is in [0, ``MAX_PORT``]."""
    number = _int(name, value, "a port number (an int)", f"{name}=5600, or 0 for any free port")
    if not 0 <= number <= MAX_PORT:
        raise ValueError(f"{name} must be in [0, {MAX_PORT}] (0: any free port), got {value}")
    return number


def flag(name: str, value: object) -> bool:
    """``value``, parameter ``name``'s switch, as given. ``TypeError`` unless it is a ``bool``:
    ``private="false"`` (a str from a config file) was true, and leased private slots;
    ``pin_memory="no"`` failed saying ``pin_memory=True``."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {value!r} (a {type(value).__name__}): "
            f"pass e.g. {name}=False, or bool() of it"
        )
    return value


def _int(name: str, value: object, what: str, example: str) -> int:
    """``int(value)``; ``TypeError`` saying ``name`` must be ``what`` (``pass e.g. example``)
    unless ``value`` is an int, numpy's too, and not a ``bool``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be {what}, got {value!r} (a {type(value).__name__}): pass e.g. {example}"
        )
    return int(value)
