"""The backend of a group that spans hosts (what the default backend picks there, see
select.py): shared memory within each host, TCP among the host leaders
(docs/design-hierarchical.md)."""
import functools
import inspect

from ..core import fingerprint as F
from ..core.errors import DistBackendError, DistError
from .base import Backend

# A hierarchical all_reduce of at least PIPE_MIN bytes runs in pieces of PIPE_PIECE bytes
# (more where it would take over PIPE_MAX_PIECES), so that the leaders' TCP part of one piece
# overlaps the shared-memory parts of the pieces beside it (docs/design-hierarchical.md).
PIPE_MIN = 4 << 20
PIPE_PIECE = 1 << 20
PIPE_SHIFT = 8  # the leaders number a collective's pieces in its low bits
PIPE_MAX_PIECES = 1 << PIPE_SHIFT


def _prefixed(store, prefix):
    from ..store import PrefixStore
    return PrefixStore(prefix, store)


def _tcp(store, rank, size, timeout, options, rank_names=None):
    from .tcp import TcpBackend
    return TcpBackend(store, rank, size, timeout, options, rank_names=rank_names)


def _breaks_group(method):
    """A hierarchical collective: a failure in any part leaves the group unusable, and its
    later collectives say so (the parts may be left in different states)."""
    @functools.wraps(method)
    def run(self, *args):
        if self._failed is not None:
            raise DistBackendError(f"{self.name} group (size {self.size}) {method.__name__}: "
                                   f"group unusable after an earlier failure: {self._failed}")
        try:
            return method(self, *args)
        except DistError as e:
            self._failed = str(e)
            raise
    return run


class HierarchicalBackend(Backend):
    """A group spanning hosts: shared memory within a host, TCP between hosts.

    Each host's lowest rank is its leader; the leaders form a TCP group (leader rank =
    host index, hosts in order of their lowest rank). A collective is done within each
    host in shared memory, among the leaders over TCP, and within each host again:

    * all_reduce: reduce to the leader, all_reduce among leaders, broadcast from it;
    * broadcast: within the root's host, among leaders, within the other hosts;
    * reduce: reduce to each leader, reduce among leaders to the root's host, and from
      its leader to the root;
    * all_gather: gather each host's blocks at its leader, all_gather the host blocks
      among leaders, then broadcast the output within each host (blocked hosts only);
    * reduce_scatter: reduce the whole input to each leader, reduce_scatter the host
      blocks among leaders, scatter each host's part within it (blocked hosts only);
    * barrier: within hosts, among leaders, within hosts.

    all_gather and reduce_scatter are hierarchical when hosts hold equal runs of
    consecutive ranks (host h: ranks h*L .. h*L+L-1, as launchers place them): host
    blocks are then slices of the user's buffers. Otherwise, as gather, scatter,
    all_to_all and point-to-point always, they go over a TCP backend spanning the whole
    group. Measured with faked hosts (bench/bench_hier.py, loopback between hosts):
    staging interleaved hosts' blocks through padded scratch took 1.3-1.9x the whole
    group's TCP time at 1-16 MiB, and gathering or scattering through the leaders 2-3x
    (every rank's block crosses to or from the root either way); and a receive from any
    source must see every sender on one transport.

    Fingerprints: every part of a collective carries the fingerprint of the ORIGINAL call
    (kind, dtype, count, root, op; collectives.core.fingerprint), so ranks of one host that
    called different collectives raise in the shared-memory part, naming both calls as the
    group's ranks and collective number, and leaders whose hosts called different ones
    raise in the TCP part. A failure in one part reaches the ranks waiting in another: a
    leader whose TCP part failed records the error in its host's segment (its host's ranks
    raise it), and a leader whose host found a mismatch makes the other leaders' TCP part
    fail with the mismatched call (where the TCP backend takes fingerprints). A host whose
    first shared-memory part would come after the leaders' (a broadcast's other hosts), and
    every call made over the whole group's TCP backend, compare first within the host and
    among the leaders (a barrier carrying the call's fingerprint): every host has compared
    before any leader goes on, and a rank that made a call hierarchically meets one that
    made another over the whole group in one exchange. Buffers are
    not guaranteed untouched by a mismatch between hosts: a host's ranks have reduced into
    their leader's buffer by the time the leaders compare.
    """

    name = "gloo-hier"
    own_block_in_place = True

    def __init__(self, store, rank, size, timeout, options, hosts):
        super().__init__(store, rank, size, timeout, options)
        from .shm import ShmBackend
        order = sorted(set(hosts), key=hosts.index)  # hosts in order of their lowest rank
        self.members = [[r for r in range(size) if hosts[r] == h] for h in order]
        self.host_of = [order.index(h) for h in hosts]
        self.local_index = [self.members[self.host_of[r]].index(r) for r in range(size)]
        self.host_index = self.host_of[rank]
        local = self.members[self.host_index]
        self.local_ranks = local
        self.is_leader = rank == local[0]
        # host h holds ranks h*L .. h*L+L-1: host blocks are slices of the user's buffers
        n_local = len(local)
        self.blocked = all(m == list(range(h * n_local, (h + 1) * n_local))
                           for h, m in enumerate(self.members))
        self.world = _tcp(_prefixed(store, "hier/world"), rank, size, timeout, options)
        self.local = ShmBackend(_prefixed(store, f"hier/host{self.host_index}"), local.index(rank),
                                len(local), timeout, options,
                                label=f"shm host {self.host_index} of group (size {size})",
                                rank_names=local)
        self.leaders = None
        if self.is_leader:
            self.leaders = _tcp(_prefixed(store, "hier/leaders"), self.host_index,
                                len(self.members), timeout, options,
                                rank_names=[m[0] for m in self.members])
            self.leaders.set_seq_shift(PIPE_SHIFT)
        self._piece_thread = None  # a leader's thread for the TCP part of pipelined pieces
        # whether the TCP backend's collectives carry a caller's fingerprint (fp=)
        self._tcp_fp = "fp" in inspect.signature(self.world.all_reduce).parameters
        self._seq = 0      # this group's collectives so far (the numbering in messages)
        self._word = 0     # the fingerprint of the collective running now
        self._failed = None  # the first collective's failure: the group is unusable after it

    # ---- fingerprints: every part carries the original call's -------------------------
    def _begin(self, word):
        self._seq += 1
        self._word = word
        if self.leaders is not None:
            self.leaders.number_next(self._seq)

    def _local(self, method, *args):
        """A shared-memory part. On a leader whose host found a mismatch, the other leaders'
        TCP part is made to fail too (they would wait for this leader until the timeout).
        Each part is numbered as the call (a mismatch found in a call's second part, its
        verdict, was named as the next collective)."""
        self.local.number_next(self._seq)
        try:
            method(*args, fp=self._word)
        except DistError as e:
            self._tell_leaders(e)
            raise

    def _tell_leaders(self, exc):
        """The leaders' part of this collective fails on every leader with this leader's
        error (a mismatch's is the host's record, naming both calls), instead of waiting for this
        leader until the timeout. (Presenting one of the host's fingerprints to the leaders
        would pass where the other hosts called that one.)"""
        if self.leaders is None or not hasattr(self.leaders, "fail_next"):
            return
        self.leaders.fail_next(str(exc))  # (a mismatch's error is the host's record)

    def _whole(self, word):
        """Before a call over the whole group's TCP backend: compare within each host and
        among the leaders first, so that a rank that made the call hierarchically and one
        that made it over the whole group (a mismatch) meet in one exchange."""
        self._begin(word)
        self._local(self.local.barrier)
        if self.leaders is not None:
            self._leaders(self.leaders.barrier)
        self._verdict()

    def _verdict(self):
        """A last shared-memory step (a barrier carrying the call's fingerprint) for a call
        whose host would otherwise finish before its leader's TCP part: a failure there,
        recorded in the segment by the leader, reaches the host's ranks within the call."""
        if len(self.local_ranks) > 1:
            self._local(self.local.barrier)

    def _leaders(self, method, *args):
        """The TCP part among leaders. On failure, this host's ranks (waiting for this
        leader in the next shared-memory part) raise the same error."""
        try:
            if self._tcp_fp:
                method(*args, fp=self._word)
            else:
                method(*args)
        except DistError as e:
            self.local.fail_group(str(e))
            raise

    # ---- helpers -------------------------------------------------------------------
    @staticmethod
    def _scratch(count, dtype, like=None):
        from ..core.tensors import empty_like_buffer
        buf = empty_like_buffer(count, dtype)
        if like is not None:
            buf.numpy()[:] = like.numpy()
        return buf

    # ---- collectives ---------------------------------------------------------------
    @_breaks_group
    def all_reduce(self, buf, op):
        self._begin(F.pack(F.ALL_REDUCE, buf.dtype, buf.count, -1, op))
        if buf.nbytes >= PIPE_MIN:
            return self._all_reduce_pieces(buf, op)
        self._local(self.local.reduce, buf, op, 0)
        if self.leaders is not None:
            self._leaders(self.leaders.all_reduce, buf, op)
        self._local(self.local.broadcast, buf, 0)

    def _pieces(self, buf):
        n = buf.count
        step = max(PIPE_PIECE // max(1, buf.nbytes // n), -(-n // PIPE_MAX_PIECES), 1)
        return [buf.slice(a, min(a + step, n)) for a in range(0, n, step)]

    def _all_reduce_pieces(self, buf, op):
        """all_reduce in pieces: every rank of a host reduces piece i to its leader, then
        takes piece i - 1 from it; the leader runs the leaders' all_reduce of each piece in
        a thread of its own, beside those shared-memory parts. Every rank of a host runs the
        same shared-memory calls in the same order; the leaders number the pieces as parts
        of one collective (TcpBackend.number_next)."""
        pieces = self._pieces(buf)
        if self.leaders is None:
            for i, piece in enumerate(pieces):
                self._local(self.local.reduce, piece, op, 0)
                if i:
                    self._local(self.local.broadcast, pieces[i - 1], 0)
            self._local(self.local.broadcast, pieces[-1], 0)
            return
        # the thread runs the leaders' parts one after the other as they are queued: the
        # next piece's part is queued as soon as its reduce is done, so the link does not
        # wait for this thread between pieces
        queued = []
        for i, piece in enumerate(pieces):
            self._piece_local(queued, self.local.reduce, piece, op, 0)
            queued.append(self._leaders_thread().submit(self.leaders.all_reduce, piece, op,
                                                        fp=self._word))
            if i:
                self._piece_done(queued, i - 1)
                self._piece_local(queued, self.local.broadcast, pieces[i - 1], 0)
        self._piece_done(queued, len(pieces) - 1)
        self._local(self.local.broadcast, pieces[-1], 0)

    def _leaders_thread(self):
        """The leader's thread for the leaders' TCP parts that run beside shared memory."""
        if self._piece_thread is None:
            from concurrent.futures import ThreadPoolExecutor
            self._piece_thread = ThreadPoolExecutor(1, thread_name_prefix="collectives-hier")
        return self._piece_thread

    @staticmethod
    def _settle(queued):
        for q in queued:  # (after a failure the later pieces fail at once: the group is unusable)
            try:
                q.result()
            except DistError:
                pass

    def _piece_local(self, queued, method, *args):
        """A shared-memory part beside the leaders' parts of the ``queued`` pieces: on failure
        they end first (no piece may run while the leaders are told), then the other leaders
        are told, as :meth:`_local` does."""
        self.local.number_next(self._seq)
        try:
            method(*args, fp=self._word)
        except DistError as e:
            self._settle(queued)
            self._tell_leaders(e)
            raise

    def _piece_done(self, queued, i):
        """Wait for piece i's leaders' part; on failure, this host's ranks raise it too."""
        try:
            queued[i].result()
        except DistError as e:
            self._settle(queued)
            self.local.fail_group(str(e))
            raise

    @_breaks_group
    def broadcast(self, buf, root):
        self._begin(F.pack(F.BROADCAST, buf.dtype, buf.count, root))
        rh = self.host_of[root]
        if self.host_index == rh:
            self._local(self.local.broadcast, buf, self.local_index[root])
            if len(self.members) > 1:
                # the host compares before its leader takes part (its root returned without
                # comparing): else the other hosts' readers, whose leaders agree, would
                # return and learn of a mismatch here only at their next call
                self._verdict()
            if self.leaders is not None:
                self._leaders(self.leaders.broadcast, buf, rh)
            self._verdict()
        else:
            # the host's ranks compare before its leader takes part among the leaders:
            # else a host could find a mismatch only after the others had returned
            self._local(self.local.barrier)
            if self.leaders is not None:
                self._leaders(self.leaders.broadcast, buf, rh)
            self._local(self.local.broadcast, buf, 0)

    @_breaks_group
    def reduce(self, buf, op, root):
        self._begin(F.pack(F.REDUCE, buf.dtype, buf.count, root, op))
        # the leaders reduce into scratch unless they are the root: the others' buf stays
        rh = self.host_of[root]
        acc = buf
        if self.is_leader and self.rank != root:
            acc = self._scratch(buf.count, buf.dtype, like=buf)
        self._local(self.local.reduce, acc, op, 0)
        if self.leaders is not None:
            self._leaders(self.leaders.reduce, acc, op, rh)
        if self.host_index == rh and self.local_index[root]:
            # leader to root in one shared-memory broadcast (faster here than a send
            # through the segment's rings); the other local ranks take it into scratch
            if self.is_leader:
                self._local(self.local.broadcast, acc, 0)
            else:
                self._local(self.local.broadcast, buf if self.rank == root else
                            self._scratch(buf.count, buf.dtype), 0)
        else:
            self._verdict()

    @_breaks_group
    def all_gather(self, out, inp):
        c = inp.count
        word = F.pack(F.ALL_GATHER, inp.dtype, c)
        if not self.blocked or not c:
            self._whole(word)
            return self.world.all_gather(out, inp)
        self._begin(word)
        n_local = len(self.local_ranks)
        start = self.host_index * n_local * c  # this host's blocks: a slice of out
        mine = out.slice(start, start + n_local * c)
        self._local(self.local.gather, mine if self.is_leader else None, inp, 0)
        if self.leaders is not None:
            self._leaders(self.leaders.all_gather, out, mine)
        self._local(self.local.broadcast, out, 0)

    @_breaks_group
    def gather(self, out, inp, root):
        self._whole(F.pack(F.GATHER, inp.dtype, inp.count, root))
        self.world.gather(out, inp, root)

    @_breaks_group
    def scatter(self, out, inp, root):
        self._whole(F.pack(F.SCATTER, out.dtype, out.count, root))
        self.world.scatter(out, inp, root)

    @_breaks_group
    def reduce_scatter(self, out, inp, op):
        c = out.count
        word = F.pack(F.REDUCE_SCATTER, out.dtype, c, -1, op)
        if not self.blocked or not c:
            self._whole(word)
            return self.world.reduce_scatter(out, inp, op)
        self._begin(word)
        n_local = len(self.local_ranks)
        acc = self._scratch(inp.count, inp.dtype, like=inp) if self.is_leader else inp
        self._local(self.local.reduce, acc, op, 0)  # the others' inp stays as it was
        host = None
        if self.leaders is not None:
            start = self.host_index * n_local * c  # this host's part: a slice of acc
            host = acc.slice(start, start + n_local * c)
            self._leaders(self.leaders.reduce_scatter, host, acc, op)
        self._local(self.local.scatter, out, host, 0)

    @_breaks_group
    def barrier(self):
        self._begin(F.pack(F.BARRIER))
        self._local(self.local.barrier)
        if self.leaders is not None:
            self._leaders(self.leaders.barrier)
        self._local(self.local.barrier)

    @_breaks_group
    def all_to_all(self, out, inp, out_counts, in_counts):
        self._whole(F.pack(F.ALL_TO_ALL, inp.dtype))
        self.world.all_to_all(out, inp, out_counts, in_counts)

    def isend(self, buf, dst, tag=0):
        return self.world.isend(buf, dst, tag)

    def irecv(self, buf, src, tag=0):
        return self.world.irecv(buf, src, tag)

    def set_timeout(self, timeout):
        super().set_timeout(timeout)
        for part in (self.world, self.local, self.leaders):
            if part is not None:
                part.set_timeout(timeout)

    def interrupt(self):
        # no part may unmap or free anything yet: this backend's progress thread may be
        # inside one of them until shutdown joins it
        for be in (self.leaders, self.local, self.world):
            if be is not None:
                be.interrupt()

    def shutdown(self):
        super().shutdown()
        if self._piece_thread is not None:
            self._piece_thread.shutdown(wait=False)
        for be in (self.leaders, self.local, self.world):
            if be is not None:
                be.shutdown()
