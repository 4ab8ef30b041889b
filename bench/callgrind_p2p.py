"""Instructions per point-to-point call of the front end (callgrind), load-insensitive.

Rank 0 of a world of 2 in one process, over a backend whose isend and irecv complete at
once (a self-send is refused, and a second process would add its waiting to the count):
what is counted is the front end (the op table's body, the group's dispatcher, the
flight recorder's entry, the Work and the wait), not a transport. One float32, N calls
minus 0 calls, the calling thread only (``--separate-threads=yes``, file ``*-01``),
``PYTHONHASHSEED=0``::

    for N in 0 5000; do PYTHONPATH=TREE PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --separate-threads=yes --callgrind-out-file=cg.OP.$N.%p \\
        python bench/callgrind_p2p.py OP $N; done

OP: ``send_recv`` (``dist.send`` then ``dist.recv`` from rank 1), ``isend_wait``
(``dist.isend(...).wait()``), ``recv_any`` (``dist.recv`` from any source).
"""
import sys

import numpy as np

import collectives as dist
from collectives.backends.base import Backend, DoneRequest
from collectives.store import HashStore

_DONE = DoneRequest(1)  # from rank 1, for a receive from any source


class AtOnce(Backend):
    def isend(self, buf, dst, tag=0):
        return _DONE

    def irecv(self, buf, src, tag=0):
        return _DONE


def main(op, n):
    dist.register_backend("callgrind-p2p", lambda store, rank, size, timeout, options=None:
                          AtOnce(store, rank, size, timeout, options))
    dist.init_process_group("callgrind-p2p", store=HashStore(), rank=0, world_size=2)
    b = np.ones(1, np.float32)
    f = {"send_recv": lambda: (dist.send(b, 1), dist.recv(b, 1)),
         "isend_wait": lambda: dist.isend(b, 1).wait(),
         "recv_any": lambda: dist.recv(b)}[op]
    f()
    for _ in range(n):
        f()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
