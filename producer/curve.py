"""CURVE on the ZMQ transport: who may publish to the bridge, and who may read an engine.

vLLM's publisher speaks plain TCP, so anyone who reaches a socket can write what the bridge
forwards (on ``--bind-sub``) or read and replay an engine's stream. With CURVE each side has a
key pair in ``zmq.auth``'s certificate files (``hmakv keys generate``): the side that binds is
the CURVE server and proves its key to clients, which must know its public key beforehand; the
server's ZAP handler (``CurveGate``) admits only the client keys it is given, and ZMQ stamps
every message from a client with that key (the ``User-Id`` property), so a receiver can check
that the key behind a message may send it.

One module for both ends, since they must agree on it: the engine's publisher and the bridge.
Keys are z85 text (40 characters), as ``zmq.auth`` writes them and ZMQ's options take them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

Z85_KEY_LENGTH = 40  # a 32-byte CURVE key in z85
REFUSAL_LOG_INTERVAL_S = 10.0


class CurveError(ValueError):
    """A key that cannot be used; the message names the file or value and why."""


@dataclass(frozen=True)
class KeyPair:
    """One side's CURVE identity, from a secret certificate file."""

    public: bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True)
class CurveSettings:
    """One side's CURVE: its key pair; ``server_key``, the public key of the server it connects
    to (where it connects); ``clients``, the client keys it admits where it binds (None: any
    key, so anyone who has the server's public key may connect, but no one can pose as it)."""

    keys: KeyPair
    server_key: bytes | None = None
    clients: frozenset[bytes] | None = None


def load_key_pair(path: str | Path) -> KeyPair:
    """The key pair in a ``.key_secret`` file, as ``hmakv keys generate`` writes it."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        raise CurveError(f"{path}: no CURVE certificate ({error})") from error
    if secret is None:
        raise CurveError(f"{path} holds a public key only; give the .key_secret file")
    return KeyPair(_checked(public, str(path)), _checked(secret, str(path)))


def load_public_key(spec: str) -> bytes:
    """A public key: a certificate file (public or secret), or the 40-character z85 key itself."""
    path = Path(spec)
    if path.is_file():
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as error:
            raise CurveError(f"{spec}: no CURVE certificate ({error})") from error
        return _checked(public, spec)
    if len(spec) == Z85_KEY_LENGTH:
        return _checked(spec.encode("ascii", "replace"), "the key")
    raise CurveError(f"{spec!r} is neither a certificate file nor a 40-character z85 key")


def load_public_keys(spec: str) -> frozenset[bytes]:
    """Public keys: every ``*.key`` file of a directory, or one key as ``load_public_key``."""
    path = Path(spec)
    if not path.is_dir():
        return frozenset({load_public_key(spec)})
    keys = frozenset(load_public_key(str(each)) for each in sorted(path.glob("*.key")))
    if not keys:
        raise CurveError(f"{spec}: no *.key file in the directory")
    return keys


def _checked(key: bytes, where: str) -> bytes:
    try:
        decoded = z85.decode(key) if len(key) == Z85_KEY_LENGTH else b""
    except (ValueError, KeyError):  # pyzmq raises KeyError on a character z85 lacks
        decoded = b""
    if len(decoded) != 32:
        raise CurveError(f"{where}: not a 40-character z85 CURVE key")
    return key


def serve(sock: zmq.Socket[bytes], keys: KeyPair) -> None:
    """Make ``sock`` a CURVE server (before it binds); its context needs a running ``CurveGate``,
    or ZMQ admits every client."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def connect_to(sock: zmq.Socket[bytes], keys: KeyPair, server_key: bytes) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_key`` (before it connects)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key


class CurveGate:
    """The ZAP handler of one context: admits the client keys ``admits`` accepts, counts the
    others (``refused``, and ``on_refused`` for each) and logs them, once per
    ``REFUSAL_LOG_INTERVAL_S`` at most: anyone can attempt handshakes.

    Both callables run on the handler's own thread (``zmq.auth``'s), once per handshake; they
    must be safe to call from there (reading an attribute its owner replaces whole is).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        admits: Callable[[bytes], bool],
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self._admits = admits
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self.refused = 0
        self._logged_at = -REFUSAL_LOG_INTERVAL_S
        self._authenticator = ThreadAuthenticator(ctx, log=log.getChild("zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """``zmq.auth``'s credentials-provider hook; ``key`` is z85."""
        if self._admits(key):
            return True
        self._on_refused()
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            quiet = now - self._logged_at < REFUSAL_LOG_INTERVAL_S
            if not quiet:
                self._logged_at = now
        if not quiet:
            log.warning(
                "CURVE handshake refused: client key %s is not admitted (%d refused so far)",
                key.decode("ascii", "replace"),
                self.refused,
            )
        return False

    def stop(self) -> None:
        self._authenticator.stop()
