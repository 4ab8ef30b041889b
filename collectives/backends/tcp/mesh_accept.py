"""The accepting side of the TCP transport's mesh setup, safe against strangers.

``connect_mesh`` (backends/tcp/__init__.py) listens while a group's connections form. Anyone who
can reach that port may connect, so accepting must never wait on one connection: every
connection is read without blocking, in a selector, with its own deadline
(:data:`collectives.security.auth.HANDSHAKE_TIMEOUT`, and the setup's), at most MAX_PENDING at
once (a flood evicts the oldest); one that sends garbage, too much, a stale hello or fails
authentication is closed and the wait goes on for the real peers.
"""
import errno
import selectors
import time

from ...security import auth

MAX_PENDING = 64
MORE = object()  # check()'s answer while a hello is not whole yet


class _Pending:
    __slots__ = ("sock", "hs", "buf", "deadline")

    def __init__(self, sock, hs, deadline):
        self.sock = sock
        self.hs = hs
        self.buf = b""
        self.deadline = deadline


def accept_peers(listener, count, deadline, key, check, refusals):
    """Accept connections on ``listener`` until ``count`` peers are in, or ``deadline``.

    Each connection first authenticates with ``key`` (unless None), then sends a hello
    that ``check(bytes so far, socket)`` maps to a peer id, MORE (not whole yet) or None
    (not one of ours); ``check`` may also raise (it then owns the socket), which ends the
    wait with that error.

    Returns:
        ({peer: blocking socket}, number of connections turned away); fewer than
        ``count`` peers means the deadline passed (the caller names the missing ones).
    """
    got = {}
    turned_away = 0
    pending = {}
    sel = selectors.DefaultSelector()
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, None)

    def drop(p, why=None):
        nonlocal turned_away
        pending.pop(p.sock, None)
        sel.unregister(p.sock)
        if why is not None:
            turned_away += 1
            refusals.refused(auth.peer_name(p.sock), why)
        p.sock.close()

    try:
        while len(got) < count:
            now = time.monotonic()
            for p in [p for p in pending.values() if p.deadline <= now]:
                drop(p, "no complete hello in time" if p.hs is None else
                     f"no authentication within {auth.HANDSHAKE_TIMEOUT:g} s")
            if now >= deadline:
                break
            wake = min([deadline] + [p.deadline for p in pending.values()])
            for sk, _ in sel.select(max(0.0, wake - now)):
                if sk.data is None:
                    _accept_some(listener, sel, pending, key, deadline, drop)
                    continue
                p = sk.data
                try:
                    data = p.sock.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    drop(p)
                    continue
                if not data:
                    drop(p, None if p.hs is None or p.hs.nc is None else "hung up while authenticating")
                    continue
                if p.hs is not None:
                    out, done, data = p.hs.feed(data)
                    if out and not _send_small(p.sock, out):
                        drop(p)
                        continue
                    if done is None:
                        continue
                    if done is not True:
                        drop(p, done)
                        continue
                    p.hs = None
                p.buf += data
                try:
                    peer = check(p.buf, p.sock)
                except BaseException:
                    pending.pop(p.sock, None)
                    try:
                        sel.unregister(p.sock)
                    except (KeyError, ValueError):
                        pass
                    raise
                if peer is MORE:
                    if len(p.buf) > 4096:  # no hello is this long
                        drop(p, "not a peer of this group (an endless hello)")
                    continue
                if peer is None or peer in got:
                    drop(p, "not a peer of this group (a stray, stale or garbled hello)")
                    continue
                pending.pop(p.sock)
                sel.unregister(p.sock)
                p.sock.setblocking(True)
                got[peer] = p.sock
    except BaseException:
        for s in got.values():
            s.close()
        raise
    finally:
        for p in list(pending.values()):
            drop(p)
        sel.close()
    return got, turned_away


def _accept_some(listener, sel, pending, key, deadline, drop):
    for _ in range(64):
        try:
            sock, _addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE) and pending:  # make room, or it spins
                drop(next(iter(pending.values())), "out of descriptors")
            return
        sock.setblocking(False)
        if len(pending) >= MAX_PENDING:
            drop(next(iter(pending.values())), "too many connections at once")
        now = time.monotonic()
        p = _Pending(sock, None if key is None else auth.ServerHandshake(key),
                     min(deadline, now + auth.HANDSHAKE_TIMEOUT))
        pending[sock] = p
        sel.register(sock, selectors.EVENT_READ, p)


def _send_small(sock, data):
    """Send a handshake message (tens of bytes: it fits a fresh socket's buffer)."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


__all__ = ["accept_peers", "MAX_PENDING"]
