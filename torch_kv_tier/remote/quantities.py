"""The checks of the numbers users pass: ``seconds`` for every timeout and duration, ``count``
for a number of slots, blocks or bytes, ``port`` for a TCP port. Each returns the plain
``float``/``int`` the waits, sockets and the protocol take (numpy's numbers included) or raises
``TypeError``/``ValueError`` naming the parameter, before the caller allocates, dials or starts
anything. Pure functions."""

from __future__ import annotations

import math
import numbers

MAX_WAIT_S = 1e6  # the longest timeout a session takes (every wait has one; a poll's is int ms)
MAX_COUNT = 2**63 - 1  # the largest count the protocol carries (msgpack takes no more)
MAX_PORT = 65535


def seconds(name: str, value: object, *, zero: bool = False) -> float:
    """``value``, parameter ``name``'s number of seconds, as the ``float`` every wait takes (a
    ``numpy.float32`` reaches none: Python's waits refuse it). ``TypeError`` unless it is an int
    or a float, numpy's too (not a ``bool``, a ``str``, a ``Fraction`` or a ``Decimal``);
    ``ValueError`` unless it is finite, > 0 (``zero``: >= 0) and at most ``MAX_WAIT_S``."""
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
    if not (as_float >= 0 if zero else as_float > 0) or not as_float <= MAX_WAIT_S:  # nan too
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be {bound} and at most {MAX_WAIT_S:g} s, got {value}")
    return as_float


def count(name: str, value: object) -> int:
    """``value``, parameter ``name``'s count, as the ``int`` the protocol carries (it cannot
    encode a ``numpy.int64``). ``TypeError`` unless it is an int, numpy's too (not a ``bool``,
    a ``float`` or a ``str``); ``ValueError`` unless it is > 0 and at most ``MAX_COUNT``."""
    number = _int(name, value, "a whole number (an int)", f"{name}=64, or int() of it")
    if not 1 <= number <= MAX_COUNT:
        raise ValueError(f"{name} must be > 0 and at most {MAX_COUNT}, got {value}")
    return number


def port(name: str, value: object) -> int:
    """``value``, parameter ``name``'s TCP port, as an ``int`` (0: any free port). ``TypeError``
    unless it is an int, numpy's too (not a ``bool`` or a ``float``, which ``serve`` took and
    bound wrongly or failed to bind); ``ValueError`` unless it is in [0, ``MAX_PORT``]."""
    number = _int(name, value, "a port number (an int)", f"{name}=5600, or 0 for any free port")
    if not 0 <= number <= MAX_PORT:
        raise ValueError(f"{name} must be in [0, {MAX_PORT}] (0: any free port), got {value}")
    return number


def _int(name: str, value: object, what: str, example: str) -> int:
    """``int(value)``; ``TypeError`` saying ``name`` must be ``what`` (``pass e.g. example``)
    unless ``value`` is an int, numpy's too, and not a ``bool``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be {what}, got {value!r} (a {type(value).__name__}): pass e.g. {example}"
        )
    return int(value)
