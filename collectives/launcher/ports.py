"""Ports the launcher picks for rank 0's store (:func:`free_port`)."""
import errno
import os
import socket
import time

# Ports the launcher picks come from below the kernel's ephemeral range. A port bound to
# 0 and closed again (the usual trick) can be handed to any outgoing connection before
# rank 0 listens on it; ports below the range are never handed out that way.
PORT_LO, PORT_HI = 20000, 32000
_next_port = None


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port):
    """Whether nothing listens on (or holds) ``port``, on every address as a TCPStore binds."""
    addrs = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "")]
    if socket.has_ipv6:
        addrs.append((socket.AF_INET6, "::"))
    for family, addr in addrs:
        try:
            with socket.socket(family) as s:
                s.bind((addr, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno == getattr(errno, "EADDRNOTAVAIL", None):
                continue  # no IPv6 on this host
            return False
    return True


def free_port():
    """A TCP port nobody uses that the kernel will not give to an outgoing connection
    (below the ephemeral range; successive calls in one process return different ports)."""
    global _next_port
    hi = min(PORT_HI, _ephemeral_low())
    span = hi - PORT_LO
    if span > 0:
        if _next_port is None:
            _next_port = PORT_LO + (os.getpid() * 7919 + time.monotonic_ns()) % span
        for _ in range(span):
            port = _next_port
            _next_port = PORT_LO + (_next_port + 1 - PORT_LO) % span
            if _bindable(port):
                return port
    with socket.socket() as s:  # no low port free: the kernel's choice
        s.bind(("", 0))
        return s.getsockname()[1]

