"""Point to point: send, recv, isend, irecv, P2POp, batch_isend_irecv (torch signatures).

Ranks given as ``dst``/``src`` are global ranks; ``group_dst``/``group_src`` are ranks
of ``group``. ``send``, ``recv``, ``isend`` and ``irecv`` are made from their entries in
the op table (:data:`collectives.api.opspec.SPECS`, as the collectives are): each posts
the backend's isend or irecv through the group's dispatcher (``pg.dispatch.post``), which
records it in the flight recorder and, while torch's profiler runs, in a span; a blocking
send or recv waits for it.
"""
from .group_dispatcher import post_batch
from .opspec import SPECS, build, recv_peer, send_peer
from ..core.args import check_tag
from ..core.convert import buffer, check_devices
from ..core.world import current as _group
from ..core.work import Work

isend = build(SPECS["isend"], "Start sending ``tensor`` to ``dst``; returns a Work (don't modify "
              "the tensor until it's done).", __name__)
irecv = build(SPECS["irecv"], "Start receiving into ``tensor`` from ``src`` (None: any rank; "
              "``Work.source_rank()`` names it).", __name__)
send = build(SPECS["send"], "Send ``tensor`` to global rank ``dst``; returns when the tensor may "
             "be reused.", __name__)
recv = build(SPECS["recv"], """Receive into ``tensor`` from ``src`` (None: any rank). Returns the
    sender's global rank (-1 if this rank is not in ``group``).""", __name__)


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
            peer = (send_peer if p.op is isend else recv_peer)(
                pg, p.peer if p.group_peer is None else None, p.group_peer)
            buf = buffer(p.tensor)
            if buf.device != -1:  # a CUDA tensor must not reach a host backend
                check_devices(pg, (buf,), "tensor")
            batch.append((p.op is isend, buf, peer, p.tag))
            pgs.add(pg)
    if len(pgs) == 1 and len(batch) == len(p2p_op_list):
        pg = pgs.pop()
        reqs = post_batch(pg, batch)  # the backend's one batch, where it has one
        if reqs is not None:
            return [Work(req, [p.tensor], pg) for req, p in zip(reqs, p2p_op_list)]
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
