"""The default backend ('gloo', alias 'tcp'): our own TCP transport.

One TCP connection per pair of ranks, set up through the store at construction;
the exchange loops, the reductions and the waits run in C with the GIL released
(:mod:`collectives.engines._tcp`). Blocking collectives run in the caller's thread;
``submit`` (async_op) runs them on the progress thread in issue order; isend and
irecv are posted at once and progress whenever any thread waits.

Environment:
    COLLECTIVES_IFNAME: interface whose IPv4 address peers connect to; else torch's
        GLOO_SOCKET_IFNAME (the first interface of a comma-separated list: we do not stripe
        one job across several interfaces); else the interface that routes to MASTER_ADDR
        (127.0.0.1 when MASTER_ADDR is loopback).
    COLLECTIVES_TCP_SPIN_US: how long a wait spins before blocking (default 20).
    COLLECTIVES_TCP_SOCKBUF: socket buffer bytes (default 4 MiB; 0 keeps the OS default).
    COLLECTIVES_TCP_RD_MAX, COLLECTIVES_TCP_TREE_MAX, COLLECTIVES_TCP_SEGMENT,
    COLLECTIVES_TCP_DIRECT_MAX: algorithm thresholds in bytes (see ``tcp_engine.h``);
    COLLECTIVES_TCP_DIRECT_WORLD: large all_reduce uses the two-round direct exchange up to
        this world size (default 8), the ring above it; unset, a group spanning hosts
        uses the ring at every size.
    COLLECTIVES_TCP_DUPLEX_CHUNK: bytes written per send call, and read per call while
        sends to that peer wait, so both directions of an exchange flow (default 1 MiB;
        0: no limit).
    COLLECTIVES_TCP_NO_LOWAT: true (1, yes, on) keeps SO_RCVLOWAT off.

The settings that choose an algorithm (RD_MAX, TREE_MAX, SEGMENT, DIRECT_MAX, DIRECT_WORLD,
and the ``fp_direct_world`` option) are rank 0's: it publishes them through the store at
setup and every rank uses them, whatever its own environment says (ranks that picked
different algorithms for one call would hang). The others are each rank's own.

Every collective carries this rank's fingerprint of the call
(:func:`collectives.core.fingerprint.pack` of kind, dtype, count, root, op) in each frame; a peer
whose call differs makes the call raise :class:`DistBackendError` on every rank, naming both
calls, and the group stays unusable. Point-to-point messages carry their dtype and size: a
receive of another size or dtype raises instead of truncating or reinterpreting.
"""
import operator
import os
import threading

from ... import config
from ...core import dtypes as D
from ...core.args import check_tag, timeout_seconds
from ...core import fingerprint as F
from ..base import Backend, Request
from .mesh import (advertised_host, connect_mesh, options_host,  # noqa: F401  (re-exported)
                   _interface_ipv4, spans_hosts, wire_version)

_OPS = frozenset({D.SUM, D.PRODUCT, D.MIN, D.MAX, D.BAND, D.BOR, D.BXOR})

# option name -> (env var or None, tuning key name in collectives.engines._tcp, agreed across ranks)
_TUNING = {
    "spin_us": ("COLLECTIVES_TCP_SPIN_US", "TUNE_SPIN_US", False),
    "allreduce_rd_max": ("COLLECTIVES_TCP_RD_MAX", "TUNE_ALLREDUCE_RD_MAX", True),
    "allreduce_hd_max": ("COLLECTIVES_TCP_HD_MAX", "TUNE_ALLREDUCE_HD_MAX", True),
    "tree_max": ("COLLECTIVES_TCP_TREE_MAX", "TUNE_BCAST_TREE_MAX", True),
    "segment": ("COLLECTIVES_TCP_SEGMENT", "TUNE_SEGMENT", True),
    "direct_max": ("COLLECTIVES_TCP_DIRECT_MAX", "TUNE_GATHER_DIRECT_MAX", True),
    "allreduce_direct_world": ("COLLECTIVES_TCP_DIRECT_WORLD", "TUNE_ALLREDUCE_DIRECT_WORLD", True),
    "fp_direct_world": (None, "TUNE_FP_DIRECT_WORLD", True),
    "seg_split": (None, "TUNE_SEG_SPLIT", True),
    "duplex_chunk": ("COLLECTIVES_TCP_DUPLEX_CHUNK", "TUNE_DUPLEX_CHUNK", False),
    "lowat": ("COLLECTIVES_TCP_NO_LOWAT", "TUNE_LOWAT", False),
}
_AGREED = tuple(name for name, (_, _, agreed) in _TUNING.items() if agreed)


def _env_tuning(name):
    """The value of tuning option ``name`` in this rank's environment, parsed by the
    configuration registry's rule (errors name the variable), or None where it is unset
    (the engine's default)."""
    env = _TUNING[name][0]
    if env is None or not os.environ.get(env, "").strip():
        return None
    value = config.get(env)
    if name == "lowat":  # a true value turns SO_RCVLOWAT off
        return 0 if value else None
    return int(value)


def _tuning_values(options):
    """{option: value} this rank would use: ``options`` (a dict) over the environment."""
    opts = options if isinstance(options, dict) else {}
    values = {}
    for name in _TUNING:
        value = opts.get(name)
        if value is None:
            value = _env_tuning(name)
        if value is not None:
            try:
                values[name] = operator.index(value)
            except TypeError:
                raise TypeError(f"tuning option {name} must be an int, got {value!r}") from None
    return values


_pack = F.pack
_BARRIER_FP = F.pack(F.BARRIER)


RD_MAX_ACROSS_HOSTS = 32 << 10
HD_MAX_ACROSS_HOSTS = 64 << 10


def placement_defaults(links, size):
    """Rank 0's algorithm settings that follow whether the group's ranks span hosts
    (``links``: rank 0 sees another host's address), where neither options nor the
    environment set them; the group agrees on rank 0's values (docs/between-hosts.md):

    * across hosts, the large all_reduce is the pipelined ring (one flow per link) at every
      world size: the direct exchange puts n - 1 flows into every host link;
    * across hosts, above 2 ranks, recursive doubling only up to 32 KiB: it moves log2(n)
      buffers over each link where the ring moves 2(n - 1)/n; over 1 Gbit/s links, 4 hosts,
      64 KiB took 1.8-4.3 ms by recursive doubling and 0.87-0.92 ms by the ring, 32 KiB
      0.56 and 0.60 ms;
    * across hosts, above 2 ranks, halving-doubling from there up to 64 KiB: the ring's
      bytes in 2 log2(n) rounds instead of 2(n - 1); 8 hosts, 64 KiB: 1.7-2.0 ms against
      2.9-3.7 ms by the ring, but from 256 KiB its unpipelined steps lose (7.9 against 4.5
      ms), and at 4 hosts the two were even;
    * on one host blocks go whole (``seg_split`` 1, up to the segment setting): there is
      no link to keep busy while a segment is reduced or forwarded, and each segment costs
      a wake-up (4-rank 1 MiB all_gather on a 16-CPU host: 1.46-1.60 ms in 8
      segments, 0.96-1.04 ms whole)."""
    if not links:
        return {"seg_split": 1}
    out = {"allreduce_direct_world": 1}
    if size > 2:
        out["allreduce_rd_max"] = RD_MAX_ACROSS_HOSTS
        out["allreduce_hd_max"] = HD_MAX_ACROSS_HOSTS
    return out


class TcpRequest(Request):
    """A posted isend/irecv of the tcp backend."""

    __slots__ = ("_op", "_backend")

    def __init__(self, op, backend):
        self._op = op
        self._backend = backend

    def wait(self, timeout=None):
        op = self._op
        try:
            op.wait(-1.0 if timeout is None else timeout_seconds(timeout))
        finally:
            if op.test():
                self._backend._inflight.discard(op)

    def test(self):
        done = self._op.test()
        if done:
            self._backend._inflight.discard(self._op)
        return done

    def exception(self):
        return self._op.exception()

    @property
    def source(self):
        return self._op.source

    @property
    def nbytes(self):
        """Bytes received (for a completed irecv)."""
        return self._op.nbytes


class TcpBackend(Backend):
    """'gloo': collectives and point to point over one TCP connection per peer.

    Args:
        store: the group's store (already prefixed for the group).
        rank, size: this rank and the group size.
        timeout: seconds (or timedelta) any operation may wait.
        options: optional dict of tuning overrides: spin_us, allreduce_rd_max,
            allreduce_hd_max, tree_max, segment, direct_max (bytes), allreduce_direct_world,
            fp_direct_world, duplex_chunk, lowat; and ``host``, the address to listen on and
            publish (else :func:`advertised_host`). A ``ProcessGroupGloo.Options`` gives the
            host of its first device. The algorithm thresholds are rank 0's (published
            through the store at setup); spin_us, duplex_chunk and lowat are each rank's own.
        rank_names: the rank each rank of this group is called by in error messages
            (default: itself), for a group inside another one (a hierarchical group's
            host leaders).
    """

    name = "gloo"
    own_block_in_place = True

    def __init__(self, store, rank, size, timeout, options=None, *, rank_names=None):
        from ...engines import _tcp
        secs = timeout_seconds(timeout)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank!r}")
        if secs <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        super().__init__(store, rank, size, secs, options)
        values = _tuning_values(options)  # a malformed setting raises before any connection
        fds, group = connect_mesh(store, rank, size, secs, options_host(options), rank_names)
        self._engine = _tcp.Engine(rank, size, fds, group, secs)
        if rank_names is not None:
            self._engine.set_rank_names(rank_names)
        self._inflight = set()
        self._prune_at = 64
        self._lock = threading.Lock()
        for name, value in values.items():
            if rank == 0 or not _TUNING[name][2]:
                self._engine.set_tuning(getattr(_tcp, _TUNING[name][1]), value)
        if rank == 0:
            for name, value in placement_defaults(spans_hosts(fds), size).items():
                if name not in values:
                    self._engine.set_tuning(getattr(_tcp, _TUNING[name][1]), value)
        if size > 1:
            self._agree_tuning(store, rank, group)

    def _agree_tuning(self, store, rank, group):
        """Rank 0 publishes the algorithm thresholds it uses under this connection's group id
        (unique per backend); the others take them: every rank picks the same algorithm for a
        call whatever its own environment or options say (the shm backend does the same)."""
        from ...engines import _tcp
        key = f"tcp/tuning/{group}"
        if rank == 0:
            mine = ",".join(f"{n}={self._engine.get_tuning(getattr(_tcp, _TUNING[n][1]))}"
                            for n in _AGREED)
            store.set(key, mine.encode())
            return
        raw = store.get(key)
        raw = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        for item in raw.split(","):
            name, _, value = item.partition("=")
            self._engine.set_tuning(getattr(_tcp, _TUNING[name][1]), int(value))

    # ---- helpers ---------------------------------------------------------------------
    def _check_rank(self, value, name):
        if not isinstance(value, int) or not 0 <= value < self.size:
            raise ValueError(f"{name} must be a rank in [0, {self.size}), got {value!r}")

    @staticmethod
    def _check_op(op, buf):
        if op not in _OPS or not D.op_valid(buf.dtype, op):
            raise ValueError(f"op {D.OP_NAMES.get(op, op)} is not supported for dtype "
                             f"{D.DTYPE_NAMES.get(buf.dtype, buf.dtype)} by the tcp backend")

    def tuning(self):
        """The tuning values in use, by option name."""
        from ...engines import _tcp
        return {name: self._engine.get_tuning(getattr(_tcp, key)) for name, (_, key, _) in _TUNING.items()}

    def set_tuning(self, **values):
        """Override tuning values (same names as ``options``) on this rank only: call it on
        every rank alike for the algorithm thresholds."""
        from ...engines import _tcp
        for name, value in values.items():
            if name not in _TUNING:
                raise ValueError(f"unknown tuning option {name!r}; expected one of {sorted(_TUNING)}")
            self._engine.set_tuning(getattr(_tcp, _TUNING[name][1]), int(value))

    # ---- collectives --------------------------------------------------------------------
    # fp: this rank's fingerprint of the call (fingerprint.pack); a caller that runs this
    # backend as one level of another (the hierarchical one) may pass the word of the
    # user's call instead, so that a mismatch names what the user called.
    def broadcast(self, buf, root, fp=None):
        self._check_rank(root, "root")
        if fp is None:
            fp = _pack(F.BROADCAST, buf.dtype, buf.count, root)
        self._engine.broadcast(buf.ptr, buf.nbytes, root, fp)

    def all_reduce(self, buf, op, fp=None):
        self._check_op(op, buf)
        if fp is None:
            fp = _pack(F.ALL_REDUCE, buf.dtype, buf.count, -1, op)
        self._engine.all_reduce(buf.ptr, buf.count, buf.dtype, op, fp)

    def reduce(self, buf, op, root, fp=None):
        self._check_rank(root, "root")
        self._check_op(op, buf)
        if fp is None:
            fp = _pack(F.REDUCE, buf.dtype, buf.count, root, op)
        self._engine.reduce(buf.ptr, buf.count, buf.dtype, op, root, fp)

    def all_gather(self, out, inp, fp=None):
        if out.nbytes != inp.nbytes * self.size:
            raise ValueError(f"all_gather output must hold {self.size} x {inp.count} elements, "
                             f"got {out.count}")
        if fp is None:
            fp = _pack(F.ALL_GATHER, inp.dtype, inp.count)
        self._engine.all_gather(out.ptr, inp.ptr, inp.nbytes, fp)

    def _root_blocks(self, code, mine, blocks, root, fp, what):
        """gather's and scatter's checks: ``mine`` this rank's block, ``blocks`` the root's
        ``size`` blocks (``what``: which argument; ignored off the root). Their address (0 off
        the root) and the fingerprint."""
        self._check_rank(root, "root")
        if fp is None:
            fp = _pack(code, mine.dtype, mine.count, root)
        if self.rank != root:
            return 0, fp
        if blocks is None or blocks.nbytes != mine.nbytes * self.size:
            raise ValueError(f"{what} on root must hold {self.size} x {mine.count} elements")
        return blocks.ptr, fp

    def gather(self, out, inp, root, fp=None):
        ptr, fp = self._root_blocks(F.GATHER, inp, out, root, fp, "gather output")
        self._engine.gather(ptr, inp.ptr, inp.nbytes, root, fp)

    def scatter(self, out, inp, root, fp=None):
        ptr, fp = self._root_blocks(F.SCATTER, out, inp, root, fp, "scatter input")
        self._engine.scatter(out.ptr, ptr, out.nbytes, root, fp)

    def reduce_scatter(self, out, inp, op, fp=None):
        self._check_op(op, out)
        if inp.count != out.count * self.size:
            raise ValueError(f"reduce_scatter input must hold {self.size} x {out.count} elements, "
                             f"got {inp.count}")
        if fp is None:
            fp = _pack(F.REDUCE_SCATTER, out.dtype, out.count, -1, op)
        self._engine.reduce_scatter(out.ptr, inp.ptr, out.count, out.dtype, op, fp)

    def all_to_all(self, out, inp, out_counts, in_counts, fp=None):
        n = self.size
        if len(out_counts) != n or len(in_counts) != n:
            raise ValueError(f"out_counts and in_counts must have {n} entries")
        if sum(out_counts) > out.count or sum(in_counts) > inp.count:
            raise ValueError("all_to_all counts exceed the buffers")
        if any(c < 0 for c in out_counts) or any(c < 0 for c in in_counts):
            raise ValueError("all_to_all counts must be non-negative")
        # per-peer counts differ legally: the word names kind and dtype, and every frame's
        # size is checked against what its receiver expects from that peer
        if fp is None:
            fp = _pack(F.ALL_TO_ALL, inp.dtype)
        isz = inp.itemsize
        self._engine.all_to_all(out.ptr, inp.ptr, [c * isz for c in out_counts],
                                [c * isz for c in in_counts], fp)

    def barrier(self, fp=None):
        self._engine.barrier(_BARRIER_FP if fp is None else fp)

    def set_seq_shift(self, shift):
        """For a group inside another one that may cut a collective into pieces here (the
        hierarchical group's leaders): its collective s is numbered s << shift, its pieces
        after it, and messages name s. Once, before any collective, on every rank alike."""
        self._engine.set_seq_shift(shift)

    def number_next(self, seq):
        """The next collective (or piece) begins the enclosing group's collective ``seq``."""
        self._engine.number_next(seq)

    def fail_next(self, text):
        """Fail this group's next collective on every rank with ``text`` without taking part
        in it (a hierarchical group's leader whose host's part of that collective failed)."""
        self._engine.fail_next(text)

    # ---- point to point ----------------------------------------------------------------
    def isend(self, buf, dst, tag=0):
        self._check_rank(dst, "dst")
        if dst == self.rank:
            raise ValueError(f"dst must be a rank other than this one ({self.rank})")
        check_tag(tag)
        op = self._engine.isend(buf.ptr, buf.nbytes, buf.dtype, dst, tag, buf)
        self._track(op)
        return TcpRequest(op, self)

    def irecv(self, buf, src, tag=0):
        if src is not None:
            self._check_rank(src, "src")
            if src == self.rank:
                raise ValueError(f"src must be a rank other than this one ({self.rank})")
        if self.size == 1:
            raise ValueError("irecv in a group of one rank would never complete")
        check_tag(tag)
        op = self._engine.irecv(buf.ptr, buf.nbytes, buf.dtype, -1 if src is None else src, tag, buf)
        self._track(op)
        return TcpRequest(op, self)

    def _track(self, op):
        """Keep a posted op (and its buffer) alive until it finishes, even if the caller
        drops the request; finished ones are pruned now and then."""
        inflight = self._inflight
        inflight.add(op)
        if len(inflight) > self._prune_at:
            for o in list(inflight):
                if o.test():
                    inflight.discard(o)
            self._prune_at = max(64, 2 * len(inflight))

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def seq(self):
        """Sequence number of the last collective started on this group."""
        return self._engine.seq

    def set_timeout(self, timeout):
        super().set_timeout(timeout)
        self._engine.set_timeout(float(timeout))

    def interrupt(self):
        """Close the connections: running and queued work fails at once."""
        self._engine.close()

    def shutdown(self):
        """Finish queued work, flush sends, close the connections (peers see a clean close)."""
        with self._lock:
            super().shutdown()
            self._engine.close()
            self._inflight.clear()


__all__ = ["TcpBackend", "TcpRequest", "advertised_host", "connect_mesh", "options_host"]
