"""Setting up the TCP transport's connections: one per pair of ranks, met through the
store (``connect_mesh``), each opened by a versioned hello and, where the job has a key, the
authentication handshake; and the network helpers it needs (the address a rank advertises,
an interface's address, whether a host is loopback).

The TCP engine (``collectives.engines._tcp``) takes the connected sockets from here.
"""
import fcntl
import functools
import ipaddress
import os
import secrets
import socket
import struct
import time

from ...security import auth
from ... import config
from ...core.errors import DistNetworkError
from .mesh_accept import MORE, accept_peers

_MAGIC = 0xC0117C90
# the hello and the ack start with (magic, wire version) in every version, so that a peer
# of another version is told apart before the rest is read
_PREFIX = struct.Struct("<II")    # magic, wire version
_HELLO = struct.Struct("<III")    # then: group id, rank, size
_ACK = struct.Struct("<I")        # then: rank


def wire_version():
    """The TCP engine's frame format version, which the connection hello carries."""
    from ...engines import _tcp
    return _tcp.WIRE_VERSION


def _is_loopback(host):
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def spans_hosts(fds):
    """Whether any connection in ``fds`` (-1: none) leads to another host: its peer's
    address is neither this end's nor a loopback one."""
    for fd in fds:
        if fd < 0:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                peer, local = sock.getpeername()[0], sock.getsockname()[0]
        except (OSError, IndexError, TypeError):
            continue
        try:
            if peer != local and not ipaddress.ip_address(peer).is_loopback:
                return True
        except ValueError:
            continue
    return False


def _interface_ipv4(ifname, var="COLLECTIVES_IFNAME"):
    """The IPv4 address of network interface ``ifname`` (Linux SIOCGIFADDR); ``var`` is
    the environment variable that named it, for the error."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            raise ValueError(f"{var} names interface {ifname!r}, which has no IPv4 address: "
                             f"{e}") from None
    return socket.inet_ntoa(packed[20:24])


def advertised_host():
    """The address this rank listens on and publishes to its peers."""
    for var in ("COLLECTIVES_IFNAME", "GLOO_SOCKET_IFNAME"):
        ifname = os.environ.get(var, "").split(",")[0].strip()
        if ifname:
            return _interface_ipv4(ifname, var)
    master = os.environ.get("MASTER_ADDR")
    if master:
        if _is_loopback(master):
            return "127.0.0.1"
        try:  # the local address of the interface that routes to the master
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT") or 29500)))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _recv_exact(sock, n, deadline, what):
    return auth.recv_exact(
        sock, n, deadline,
        lambda: DistNetworkError(f"tcp backend: timed out waiting for {what}"),
        lambda: DistNetworkError(f"tcp backend: connection closed while waiting for {what}"))


def _family(host):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


@functools.lru_cache(maxsize=None)
def _kernel_cap(name):
    """net.core.<name> (wmem_max, rmem_max): the most a socket option may ask for, or None
    where it cannot be read (not Linux). Read once per process, not once per peer."""
    try:
        with open(f"/proc/sys/net/core/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _tune_socket(sock, bufsize):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if bufsize > 0:
        for opt, cap in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max")):
            # Setting a buffer turns off the kernel's tuning of it; above the kernel's cap
            # (212992 B by default on Linux) it would be cut to the cap, smaller than
            # what the kernel's tuning grows to on a fast link (tcp_wmem/tcp_rmem): keep
            # the tuning instead.
            limit = _kernel_cap(cap)
            if limit is not None and limit < bufsize:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)
            except OSError:
                pass


def options_host(options):
    """The address ``options`` names for this rank to listen on, or None: a dict's
    ``host``, or the first device of torch-style ``ProcessGroupGloo.Options._devices``
    (one device: a job is not striped across several)."""
    if isinstance(options, dict):
        host = options.get("host")
    else:
        devices = getattr(options, "_devices", None) or [None]
        host = getattr(devices[0], "host", None)
    if host is not None and not isinstance(host, str):
        raise TypeError(f"the host in options must be an address string, got {host!r}")
    return host or None


def _drain_close(sock):
    """Close after reading what the peer already sent (unread data would make the close a
    reset, which could destroy the reply before the peer reads it)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.2)
        while sock.recv(4096):
            pass
    except OSError:
        pass
    sock.close()


def _version_error(me, peer, theirs, ours):
    return DistNetworkError(
        f"tcp backend: rank {me} refused the connection with {peer}: different wire protocol "
        f"versions ({peer}: {theirs}, rank {me}: {ours}); every rank of a job must run the same "
        f"collectives release")


def connect_mesh(store, rank, size, timeout, host=None, rank_names=None, version=None):
    """Connect every pair of ranks through ``store``; returns (fds, group id).

    Each rank listens, publishes host:port, connects to every lower rank and
    accepts every higher one; a hello (magic, wire version, group id, rank, size) and
    an ack (magic, wire version, rank) check that both ends belong to the same group
    and speak the same wire protocol (``version``, default :func:`wire_version`): a peer
    of another version is refused with DistNetworkError on both sides. With a key (the
    store's, or COLLECTIVES_AUTH_KEY: collectives.security.auth.key_of) every connection first
    passes the mutual challenge-response; the accepting side never waits on one
    connection (backends/tcp/mesh_accept.py). Messages call rank r ``rank_names[r]`` when given.
    """
    def nm(r):
        return rank_names[r] if rank_names is not None else r

    if version is None:
        version = wire_version()

    fds = [-1] * size
    if size == 1:
        return fds, 0
    deadline = time.monotonic() + timeout
    bufsize = config.get("COLLECTIVES_TCP_SOCKBUF")
    host = host or advertised_host()  # a bad interface name raises before the store sees us
    # a generation number keeps a second backend on the same store from reading stale keys
    gen = (int(store.add("tcp/init", 1)) - 1) // size
    prefix = f"tcp/{gen}"
    # -- authentication (security): the key, and who is refused, told once in a log --
    key = auth.key_of(store)
    refusals = auth.RefusalLog(f"tcp backend rank {nm(rank)}'s listener")
    nonces = {}
    listener = socket.socket(_family(host), socket.SOCK_STREAM)
    socks = {}
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune_socket(listener, bufsize)
        listener.bind((host, 0))
        listener.listen(max(size, 128))  # (security) room for strangers before accepting
        if rank == 0:
            group = secrets.randbits(32)
            store.set(f"{prefix}/group", str(group).encode())
        else:
            group = int(store.get(f"{prefix}/group"))
        store.set(f"{prefix}/addr/{rank}", f"{host}:{listener.getsockname()[1]}".encode())
        hello = _PREFIX.pack(_MAGIC, version) + _HELLO.pack(group, rank, size)
        for peer in range(rank):
            addr = store.get(f"{prefix}/addr/{peer}").decode()
            h, _, p = addr.rpartition(":")
            s = socket.socket(_family(h), socket.SOCK_STREAM)
            socks[peer] = s
            _tune_socket(s, bufsize)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DistNetworkError(f"tcp backend: rank {nm(rank)} could not connect to "
                                           f"rank {nm(peer)} at {addr} within {timeout} s")
                s.settimeout(remaining)
                try:
                    s.connect((h, int(p)))
                    break
                except (ConnectionRefusedError, socket.timeout) as e:
                    if isinstance(e, socket.timeout):
                        continue
                    time.sleep(0.01)
                    s.close()
                    s = socket.socket(_family(h), socket.SOCK_STREAM)
                    socks[peer] = s
                    _tune_socket(s, bufsize)
            if key is None:
                s.sendall(hello)
            else:  # (security) every peer's handshake starts now; answers are awaited together
                nonces[peer] = (auth.client_hello(s), addr)
        for peer, (nc, addr) in nonces.items():  # (security) prove the key; the hello follows
            auth.client_finish(socks[peer], key, nc, deadline, f"tcp backend: rank {nm(rank)} "
                               f"connecting to rank {nm(peer)} at {addr}", wait_ok=False)
            socks[peer].sendall(hello)

        def check_hello(buf, c):
            """The peer a hello names, MORE to wait for the rest, or None for a stray or
            stale connection; a peer of another wire version is told, then refused."""
            if len(buf) < _PREFIX.size:
                return MORE
            magic, pversion = _PREFIX.unpack_from(buf)
            if magic != _MAGIC:
                return None
            if pversion != version:
                who = "a peer at {}:{}".format(*c.getpeername()[:2])
                try:
                    c.setblocking(True)
                    c.sendall(_PREFIX.pack(_MAGIC, version) + _ACK.pack(rank))  # it raises too
                finally:
                    _drain_close(c)
                raise _version_error(nm(rank), who, pversion, version)
            if len(buf) < _PREFIX.size + _HELLO.size:
                return MORE
            if len(buf) > _PREFIX.size + _HELLO.size:
                return None
            g, peer, psize = _HELLO.unpack_from(buf, _PREFIX.size)
            if g != group or psize != size or not rank < peer < size:
                return None
            return peer

        # (security) accepting never waits on one connection: strangers are turned away
        accepted, turned_away = accept_peers(listener, size - rank - 1, deadline, key,
                                             check_hello, refusals)
        socks.update(accepted)
        if len(accepted) < size - rank - 1:
            missing = [nm(r) for r in range(rank + 1, size) if r not in socks]
            extra = f" ({turned_away} connections were turned away, e.g. without the job's key)" \
                if turned_away else ""
            raise DistNetworkError(f"tcp backend: rank {nm(rank)} timed out after {timeout} s "
                                   f"waiting for ranks {missing} to connect{extra}")
        for c in accepted.values():
            _tune_socket(c, bufsize)
            c.sendall(_PREFIX.pack(_MAGIC, version) + _ACK.pack(rank))
        for peer in range(rank):
            if key is not None:  # (security) the verdict on our proof comes before the ack
                auth.read_ok(socks[peer], deadline, f"tcp backend: rank {nm(rank)} connecting to "
                                                    f"rank {nm(peer)}")
            what = f"rank {nm(peer)}'s ack"
            magic, pversion = _PREFIX.unpack(_recv_exact(socks[peer], _PREFIX.size, deadline, what))
            if magic == _MAGIC and pversion != version:
                raise _version_error(nm(rank), f"rank {nm(peer)}", pversion, version)
            (r,) = _ACK.unpack(_recv_exact(socks[peer], _ACK.size, deadline, what))
            if magic != _MAGIC or r != peer:
                raise DistNetworkError(f"tcp backend: bad handshake from rank {nm(peer)}")
        for peer, s in socks.items():
            s.setblocking(False)
            fds[peer] = s.detach()
        socks.clear()
        return fds, group
    except OSError as e:  # unreachable host, reset, bind failure: a network error, not a raw OSError
        raise DistNetworkError(f"tcp backend: rank {nm(rank)} could not set up connections: {e}") from e
    finally:
        listener.close()
        for s in socks.values():
            s.close()
