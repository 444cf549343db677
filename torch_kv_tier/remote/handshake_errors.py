"""How a client's handshake fails (``handshake``): the errors it raises, and the sessions a
failed handshake may have opened on its server (``opened_by``), which the client names in
``release`` of its next handshake there. ``Cancelled`` and ``Closed`` are ``handshake``'s own,
never raised to its caller.
"""

from __future__ import annotations

from torch_kv_tier.remote import protocol as p

# the refusal of a server that did not prove it knows the token a client passed
NO_PROOF = "server did not prove it knows the token"


# what a user does about a refusal whose reason starts with the key (the message ends with it;
# ``reason`` stays the server's exact words)
_ADVICE = {
    "bad token": "pass connect(..., token=) the contents of the host's --token-file",
    NO_PROOF: (
        "the host there was started without --token-file or with another token: pass no token "
        "to a host without one, or check the address"
    ),
    "block_len ": (
        "the tier's block_len comes first, the host's second: create the tier with the host's "
        "block_len, or start the host with --block-len of the tier's"
    ),
    "config fingerprint mismatch": (
        "the host serves one model (its --config-fields): create the tier with the same "
        "config_fields, or use a host of this model"
    ),
    "protocol version ": (
        "the tier's version comes first, the host's second: run the same torch_kv_tier "
        "release on both"
    ),
}


def _advice(reason: str) -> str:
    for start, advice in _ADVICE.items():
        if reason.startswith(start):
            return f" ({advice})"
    return ""


class HandshakeRejected(Exception):
    """The server refused the handshake; ``reason`` is its exact explanation, e.g.
    ``"block_len 65536 != 32768"``, ``"config fingerprint mismatch"``, ``"bad token"``,
    ``"no free slots"``, ``"protocol version 5 != 4"`` or ``"malformed frame: ..."`` (it could
    not decode the request: a version skew or a bug); or ``NO_PROOF``, this client's own, when
    the server did not prove it knows the token the client passed. The message adds what to do
    about a refusal of this client (a token, a block length, a model, a version)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(
            f"torch-kv-tier server at {address} rejected the handshake: {reason}{_advice(reason)}"
        )
        self.address = address
        self.reason = reason
        # sessions earlier greetings of the handshake may have opened (``opened_by``)
        self.session_ids: list[str] = []

    @property
    def busy(self) -> bool:
        """Whether the refusal is of the host's state now (``no free slots``, ``too many
        sessions``, ``... try again later``), which waiting may mend, rather than of this
        client (a bad token, another block length or namespace, a protocol version)."""
        reason = self.reason
        return reason.startswith((p.NO_FREE_SLOTS, p.TOO_MANY_SESSIONS)) or reason.endswith(
            p.TRY_AGAIN_LATER
        )


class AcceptLost(TimeoutError):
    """No ``Accept`` by the deadline, after a ``Handshake`` went out: the server may have
    opened session ``session_id`` (and leased slots to it) without this client learning of it,
    and so may the earlier ``Handshake``s of this handshake whose connection closed before
    their answer came (``session_ids`` names them all, ``session_id`` last). Pass
    ``session_ids`` in ``release`` of the next ``RemoteSession.open`` to that server (a
    ``TierManager`` does so itself) so that it ends those sessions."""

    def __init__(self, address: str, *session_ids: str) -> None:
        super().__init__(
            f"no answer from the torch-kv-tier server at {address} to the handshake: it may have"
            f" opened a session this client never learned of; name it in release= of the next"
            f" handshake there ({session_ids[-1][:8]}... in AcceptLost.session_ids)"
        )
        self.address = address
        self.session_ids = list(session_ids)
        self.session_id = session_ids[-1]


class AcceptAbandoned(ConnectionError):
    """The handshake's ``cancel`` was set while it awaited the ``Accept`` (the tier closing, or
    no longer dialling the host): the server may have opened session ``session_id`` (and the
    others of ``session_ids``, as ``AcceptLost``'s). A clean ``Disconnect`` of ``session_id``
    was queued behind its ``Handshake`` (close the socket with ``close_sockets(...,
    linger=True)`` for it to go out); name ``session_ids`` in ``release`` of the next handshake
    there too, in case it did not."""

    def __init__(self, address: str, *session_ids: str) -> None:
        super().__init__(
            f"handshake with {address} cancelled while it awaited the server's accept: the tier "
            f"is closing, or no longer dials it ({session_ids[-1][:8]}... is to be released "
            "there)"
        )
        self.address = address
        self.session_ids = list(session_ids)
        self.session_id = session_ids[-1]


def not_ready(exc: BaseException) -> bool:
    """Whether a connect that failed with ``exc`` found its host not ready rather than
    refusing this client, so that dialling it again may succeed: no answer (``TimeoutError``),
    lost while it joined (``ConnectionError``), or a ``busy`` refusal."""
    if isinstance(exc, HandshakeRejected):
        return exc.busy
    return isinstance(exc, TimeoutError | ConnectionError)


def opened_by(exc: BaseException) -> list[str]:
    """The sessions a failed ``handshake`` may have opened on its server (``exc`` its error),
    to be named in ``release`` of the next handshake there; ``[]`` when none."""
    if isinstance(exc, AcceptLost | AcceptAbandoned | HandshakeRejected):
        return list(exc.session_ids)
    return []


class Cancelled(ConnectionError):
    """A handshake's ``cancel`` was set while it awaited an answer."""


class Closed(ConnectionError):
    """The control connection closed while a handshake awaited an answer; ``session_id``: the
    session its ``Handshake`` may have opened, or ``None`` (closed before it went out)."""

    def __init__(self, session_id: str | None) -> None:
        super().__init__("the control connection closed")
        self.session_id = session_id


def naming(exc: Exception, address: str, lost: list[str]) -> Exception:
    """``handshake``'s failure ``exc``, naming too the sessions ``lost`` (those the
    ``Handshake``s of its closed connections may have opened, for ``opened_by``): a
    ``HandshakeRejected`` itself, with them in its ``session_ids``; else an ``AcceptLost`` (an
    ``AcceptAbandoned`` once cancelled) naming them, and the session of ``exc``'s own."""
    if not lost:
        return exc
    if isinstance(exc, AcceptLost | AcceptAbandoned):
        return type(exc)(address, *lost, *exc.session_ids)
    if isinstance(exc, HandshakeRejected):
        exc.session_ids = [*lost, *exc.session_ids]
        return exc
    if isinstance(exc, Cancelled):
        return AcceptAbandoned(address, *lost)
    return AcceptLost(address, *lost)
