"""Point to point: send, recv, isend, irecv, P2POp, batch_isend_irecv (torch signatures).

Ranks given as ``dst``/``src`` are global ranks; ``group_dst``/``group_src`` are ranks
of ``group``. A blocking send is ``isend(...).wait()``.
"""
from .. import flight_recorder as _flight
from ..core import profiling as _profiling
from ..core.args import check_tag
from ..core.plans import buffer, check_devices
from ..core.world import current as _group
from ..core.work import Work

_prof = _profiling.tap  # torch's profiler module once torch is imported (profiling.bind)
_profiling.bind(globals())


def _dst(pg, dst, group_dst):
    peer = pg.peer(dst, group_dst, "dst")
    if peer == pg._rank:
        raise ValueError("Invalid destination rank: destination rank should not be the same as "
                         "the rank of the current process.")
    return peer


def _src(pg, src, group_src):
    if src is None and group_src is None:
        return None  # any source
    peer = pg.peer(src, group_src, "src")
    if peer == pg._rank:
        raise ValueError("Invalid source rank: source rank should not be the same as "
                         "the rank of the current process.")
    return peer


def _buffer(pg, tensor):
    buf = buffer(tensor)
    if buf.device != -1:  # a CUDA tensor must not reach a host backend
        check_devices(pg, (buf,), "tensor")
    return buf


def _post(pg, send, buf, peer, tag, anywhere=True):
    """The backend's isend (``send``) or irecv, recorded by the flight recorder (as
    isend/irecv, or send/recv when blocking: not ``anywhere``); while torch's profiler
    runs, one span under torch gloo's name (send, recv, recvAnySource) until it is found
    done (a blocking call's closes on its own thread)."""
    post = pg.backend.isend if send else pg.backend.irecv
    kind = "send" if send else "recv"
    span = None
    if _prof._is_profiler_enabled:
        name = kind if send or peer is not None else "recvAnySource"
        req, span = _profiling.issue(pg, name, anywhere, post, buf, peer, tag)
    else:
        req = post(buf, peer, tag)
    return _flight.p2p(pg, "i" + kind if anywhere else kind, req, peer, tag, buf, span)


def _start(send, tensor, group, tag, rank, group_rank):
    """isend's or irecv's Work (None on a rank outside ``group``)."""
    pg = _group(group)
    if pg is None:
        return None
    peer = (_dst if send else _src)(pg, rank, group_rank)
    check_tag(tag)  # [0, 2**31) on every backend (mpi: up to MPI_TAG_UB, checked there)
    return Work(_post(pg, send, _buffer(pg, tensor), peer, tag), [tensor], pg)


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Start sending ``tensor`` to ``dst``; returns a Work (don't modify the tensor until it's done)."""
    return _start(True, tensor, group, tag, dst, group_dst)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """Start receiving into ``tensor`` from ``src`` (None: any rank; ``Work.source_rank()`` names it)."""
    return _start(False, tensor, group, tag, src, group_src)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Send ``tensor`` to global rank ``dst``; returns when the tensor may be reused."""
    pg = _group(group)
    if pg is None:
        return None
    peer = _dst(pg, dst, group_dst)
    check_tag(tag)
    _post(pg, True, _buffer(pg, tensor), peer, tag, False).wait()
    return None


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """Receive into ``tensor`` from ``src`` (None: any rank). Returns the sender's global rank
    (-1 if this rank is not in ``group``)."""
    pg = _group(group)
    if pg is None:
        return -1
    peer = _src(pg, src, group_src)
    check_tag(tag)
    req = _post(pg, False, _buffer(pg, tensor), peer, tag, False)
    req.wait()
    got = req.source if peer is None else peer
    if got < 0:
        raise RuntimeError(f"{pg.backend_name} backend did not report the sender of an any-source recv")
    return pg.ranks[got]


class P2POp:
    """One isend/irecv for :func:`batch_isend_irecv`.

    Example:
        >>> ops = [dist.P2POp(dist.isend, t, peer=1), dist.P2POp(dist.irecv, r, peer=1)]
        >>> for w in dist.batch_isend_irecv(ops): w.wait()
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer")

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        if op not in (isend, irecv):
            raise ValueError("Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` "
                             "or ``torch.distributed.irecv``.")
        if peer is None and group_peer is None:
            raise ValueError("P2POp needs peer (a global rank) or group_peer")
        check_tag(tag)
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer

    def __repr__(self):
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list):
    """Post every op of ``p2p_op_list`` in order; returns their Works."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("p2p_op_list must be a non-empty list of P2POp")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"p2p_op_list[{i}] must be a P2POp, got {type(p).__name__}")
    # check everything before posting anything
    batch, pgs = [], set()
    for p in p2p_op_list:
        pg = _group(p.group)
        if pg is not None:
            peer = (_dst if p.op is isend else _src)(pg, p.peer if p.group_peer is None else None,
                                                   p.group_peer)
            batch.append((p.op is isend, _buffer(pg, p.tensor), peer, p.tag))
            pgs.add(pg)
    if len(pgs) == 1 and len(batch) == len(p2p_op_list) and not _prof._is_profiler_enabled:
        pg = pgs.pop()
        post = getattr(pg.backend, "batch_p2p", None)
        if post is not None:  # one NCCL group: a ring of isend/irecv cannot deadlock
            return [Work(req, [p.tensor], pg) for req, p in zip(post(batch), p2p_op_list)]
    works = []
    for p in p2p_op_list:
        if p.group_peer is None:
            w = p.op(p.tensor, p.peer, p.group, p.tag)
        elif p.op is isend:
            w = isend(p.tensor, group=p.group, tag=p.tag, group_dst=p.group_peer)
        else:
            w = irecv(p.tensor, group=p.group, tag=p.tag, group_src=p.group_peer)
        if w is not None:
            works.append(w)
    return works


__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]
