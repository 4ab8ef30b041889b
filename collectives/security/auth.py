"""Shared-key authentication of a job's connections (store and TCP transport).

A job has one secret key: ``collectives-run`` makes a random one per job (or takes
``--auth-key-file``) and hands it to its ranks in ``COLLECTIVES_AUTH_KEY``; a program may
also pass ``auth_key=`` to :class:`~collectives.store.TCPStore` or ``init_process_group``.
Every connection to a store server, and every rank-to-rank connection of the TCP
transport, then opens with a mutual challenge-response: each side proves it holds the
key with an HMAC-SHA256 over fresh nonces from both sides; the key never crosses the
wire. Without a key anywhere nothing changes (no handshake: torch's behaviour).

The handshake (client connects, speaks first)::

    C -> S  MAGIC, Nc (32 random bytes)
    S -> C  MAGIC, Ns (32 random bytes), HMAC(key, "server" | Nc | Ns)
    C -> S  HMAC(key, "client" | Nc | Ns)
    S -> C  one byte: OK (1) or REFUSED (0), then the server hangs up

MAGIC's first byte (0xC0) cannot begin a store frame (a length above the cap), so a
store server without a key refuses a keyed client, and one with a key refuses a
keyless client's first frame, each with a message naming authentication.
"""
import hashlib
import hmac
import logging
import os
import socket
import threading
import time

from ..core.errors import DistNetworkError

ENV_KEY = "COLLECTIVES_AUTH_KEY"
MAGIC = b"\xc0CLAUTH1"
NONCE = 32
MAC = 32
HELLO_SIZE = len(MAGIC) + NONCE            # client's first message
CHALLENGE_SIZE = len(MAGIC) + NONCE + MAC  # the server's answer
PROOF_SIZE = MAC                           # the client's proof
OK, REFUSED = b"\x01", b"\x00"
HANDSHAKE_TIMEOUT = 10.0  # seconds a server gives a connection to authenticate
REFUSED_MARK = "authentication required"  # starts the store server's refusal of a keyless frame

log = logging.getLogger("collectives.auth")


def check_key(key, name="auth_key"):
    """``key`` (str or bytes) as bytes; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(key, str):
        key = key.encode()
    elif isinstance(key, (bytes, bytearray, memoryview)):
        key = bytes(key)
    else:
        raise TypeError(f"{name} must be str or bytes, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{name} must not be empty")
    return key


def env_key(environ=None):
    """The key in COLLECTIVES_AUTH_KEY (bytes), or None when unset or empty."""
    raw = (os.environ if environ is None else environ).get(ENV_KEY)
    return raw.encode() if raw else None


def resolve_key(auth_key=None):
    """An explicit ``auth_key``, else COLLECTIVES_AUTH_KEY's, else None (no authentication)."""
    return check_key(auth_key) if auth_key is not None else env_key()


def key_of(store, env=True):
    """The key a group met with: the first one along ``store``'s PrefixStore chain, else
    (with ``env``) COLLECTIVES_AUTH_KEY's, else None."""
    seen = 0
    while store is not None and seen < 64:
        key = getattr(store, "_auth_key", None)
        if key is not None:
            return key
        store = getattr(store, "underlying_store", None)
        seen += 1
    return env_key() if env else None


def _mac(key, role, nc, ns):
    return hmac.new(key, role + nc + ns, hashlib.sha256).digest()


class AuthError(DistNetworkError):
    """A connection was refused because the two ends do not share a key."""


def recv_exact(sock, n, deadline, timed_out, closed):
    """``n`` bytes from the blocking socket ``sock`` by ``deadline`` (time.monotonic());
    raises ``timed_out()`` when the deadline passes first, ``closed()`` when the peer
    closes the connection (each a callable that makes the exception)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise timed_out()
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            continue
        if not chunk:
            raise closed()
        buf += chunk
    return bytes(buf)


def _recv_exact(sock, n, deadline, where):
    return recv_exact(
        sock, n, deadline,
        lambda: DistNetworkError(f"{where}: timed out during the authentication handshake"),
        lambda: ConnectionResetError(f"{where}: the server closed the connection during the "
                                     f"authentication handshake"))


def client_handshake(sock, key, deadline, where, wait_ok=True):
    """Authenticate a freshly connected blocking socket as the client. Raises AuthError
    (the ends hold different keys, or the server has none), DistNetworkError on a timeout,
    OSError when the connection breaks (the caller may try again).

    ``wait_ok=False`` returns once the client's proof is sent, so that its first message
    travels right behind it (one round trip saved); the caller must then call
    :func:`read_ok` before it reads anything else from the socket."""
    client_finish(sock, key, client_hello(sock), deadline, where, wait_ok)


def client_hello(sock):
    """The client's first message; returns its nonce for :func:`client_finish` (a client
    with several servers to reach sends every hello first, then waits for the answers
    together)."""
    nc = os.urandom(NONCE)
    sock.sendall(MAGIC + nc)
    return nc


def client_finish(sock, key, nc, deadline, where, wait_ok=True):
    """The rest of :func:`client_handshake` after :func:`client_hello`."""
    head = _recv_exact(sock, len(MAGIC), deadline, where)
    if head != MAGIC:
        raise AuthError(f"{where}: authentication failed: the server does not authenticate "
                        f"(it answered the handshake with {head[:8]!r}), and this process has a "
                        f"key; refusing to talk to it (give it the same key, or unset "
                        f"{ENV_KEY} here)")
    rest = _recv_exact(sock, NONCE + MAC, deadline, where)
    ns, smac = rest[:NONCE], rest[NONCE:]
    sock.sendall(_mac(key, b"client", nc, ns))  # sent either way: the server logs a mismatch
    if not hmac.compare_digest(smac, _mac(key, b"server", nc, ns)):
        raise AuthError(f"{where}: authentication failed: the server holds a different key "
                        f"({ENV_KEY} / auth_key differ between this process and the server)")
    if wait_ok:
        read_ok(sock, deadline, where)


def read_ok(sock, deadline, where):
    """The server's verdict on the client's proof (see ``client_handshake``)."""
    try:
        verdict = _recv_exact(sock, 1, deadline, where)
    except ConnectionResetError:
        verdict = b""
    if verdict != OK:
        raise AuthError(f"{where}: authentication failed: the server refused this client's proof")


class ServerHandshake:
    """The server's half, fed bytes as they arrive (for selector loops).

    ``feed(data)`` returns ``(reply, done, rest)``: bytes to send, then None while more is
    needed, True once the client proved it holds the key (``rest``: bytes after the
    proof), or a reason string when it is refused (send ``reply``, then close).
    """

    __slots__ = ("key", "nc", "ns", "buf", "deadline")

    def __init__(self, key, timeout=None):
        self.key = key
        self.nc = None
        self.ns = os.urandom(NONCE)
        self.buf = b""
        self.deadline = time.monotonic() + (HANDSHAKE_TIMEOUT if timeout is None else timeout)

    def feed(self, data):
        self.buf += data
        if self.nc is None:
            if self.buf[:len(MAGIC)] != MAGIC[:len(self.buf)]:
                return b"", "no authentication handshake (a client without the key?)", b""
            if len(self.buf) < HELLO_SIZE:
                return b"", None, b""
            self.nc, self.buf = self.buf[len(MAGIC):HELLO_SIZE], self.buf[HELLO_SIZE:]
            reply = MAGIC + self.ns + _mac(self.key, b"server", self.nc, self.ns)
            out, done, rest = self.feed(b"")
            return reply + out, done, rest
        if len(self.buf) < PROOF_SIZE:
            return b"", None, b""
        proof, rest = self.buf[:PROOF_SIZE], self.buf[PROOF_SIZE:]
        self.buf = b""
        if not hmac.compare_digest(proof, _mac(self.key, b"client", self.nc, self.ns)):
            return REFUSED, "wrong key (its proof did not match)", b""
        return OK, True, rest


class RefusalLog:
    """One log line per refused connection, at most one per ``every`` seconds (a flood of
    bad connections must not flood the log): later ones are counted into the next line."""

    def __init__(self, what, every=10.0):
        self.what = what
        self.every = every
        self.last = -1e18
        self.quiet = 0
        self.lock = threading.Lock()

    def refused(self, peer, why):
        with self.lock:
            now = time.monotonic()
            if now - self.last < self.every:
                self.quiet += 1
                return
            quiet, self.quiet, self.last = self.quiet, 0, now
        more = f" ({quiet} more refused since the last message)" if quiet else ""
        log.warning("%s refused a connection from %s: %s%s", self.what, peer, why, more)


def peer_name(sock):
    try:
        addr = sock.getpeername()
        return f"{addr[0]}:{addr[1]}"
    except (OSError, IndexError, TypeError):
        return "an unknown peer"


__all__ = ["ENV_KEY", "AuthError", "ServerHandshake", "check_key", "client_handshake",
           "env_key", "key_of", "recv_exact", "resolve_key"]
