"""``monitored_barrier``: a barrier in which rank 0 names the ranks that did not arrive
(torch's), made of point-to-point messages with a deadline rather than a collective."""
import time

import numpy as np

from ..core import dtypes as D
from ..core.world import current as _group
from ..core.errors import DistBackendError, DistError
from .tracked import Tracked
from ..core.tensors import Buffer
from ..core.work import timeout_seconds

_MONITOR_TAG = 0x3FFFFFF0


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """A barrier in which rank 0 names the ranks that did not arrive within ``timeout``.

    Raises DistError on rank 0 naming the missing rank (all of them with
    ``wait_all_ranks``), and on the others when rank 0 does not answer. Its messages are
    point-to-point ones on tag 0x3FFFFFF0 (or the backend's largest tag, where lower:
    MPI_TAG_UB on mpi).
    """
    pg = _group(group)
    if pg is None:
        return None
    tmo = timeout_seconds(timeout)
    tmo = pg.timeout if tmo is None else tmo
    if pg._size == 1:
        return None
    # point to point in this thread, recorded as one collective by the recorder's own hook
    # (Tracked), not through the group's dispatcher: as torch's gloo runs it, it neither
    # waits behind the group's queued work (a diagnosis of a group that may hang there)
    # nor opens a profiler span
    Tracked(pg.fr, pg.fr.issue("monitored_barrier"), _monitored_barrier)(pg, tmo, wait_all_ranks)
    return None


def _monitored_barrier(pg, tmo, wait_all_ranks):
    n, me, be = pg._size, pg._rank, pg.backend
    tag = min(_MONITOR_TAG, be.max_tag)
    token = np.zeros(1, np.int64)
    buf = Buffer(token.ctypes.data, 1, D.INT64, -1, token)
    if me != 0:
        try:
            be.isend(buf, 0, tag).wait(tmo)
            be.irecv(buf, 0, tag).wait(tmo)
        except DistError as e:
            raise DistBackendError(f"monitored_barrier: rank {pg.ranks[me]} got no answer from "
                                   f"rank {pg.ranks[0]} within {tmo} s: {e}") from e
        return None
    tokens = [np.zeros(1, np.int64) for _ in range(n)]
    reqs = [(r, be.irecv(Buffer(tokens[r].ctypes.data, 1, D.INT64, -1, tokens[r]), r, tag))
            for r in range(1, n)]
    deadline = time.monotonic() + tmo
    missing = []
    for r, req in reqs:
        try:
            req.wait(max(0.0, deadline - time.monotonic()))
        except DistError:
            missing.append(pg.ranks[r])
            if not wait_all_ranks:
                break
    if missing:
        # The receives of the late ranks stay posted on purpose: a token that arrives
        # after this failure lands in them, not in the next monitored_barrier's receive.
        which = f"Rank {missing[0]}" if len(missing) == 1 else f"Ranks {', '.join(map(str, missing))}"
        raise DistBackendError(f"{which} failed to pass monitoredBarrier in {int(tmo * 1000)} ms")
    for r in range(1, n):
        be.isend(buf, r, tag).wait(tmo)
    return None
