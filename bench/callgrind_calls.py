"""Instructions per call of six small collectives at world 1 on shared memory (callgrind).

``python bench/callgrind_calls.py OP N`` sets up a world of one, calls ``dist.OP`` on a
one-element float32 once, then N times. ``bench/callgrind_calls.sh TREE LABEL`` runs it
under valgrind for N = 0 and N = 5000 and prints ``(instructions of 5000 - of 0) / 5000``
for each op, the calling thread only (``--separate-threads=yes``), ``PYTHONHASHSEED=0``.
The C engine returns at once at world 1, so this counts the Python and Cython per call;
repeat runs of one tree agree within about +-70.
"""
import sys

import numpy as np

import collectives as dist
from collectives.store import HashStore

op, n = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
b = np.ones(1, np.float32)
o = np.ones(1, np.float32)
calls = {
    "broadcast": lambda: dist.broadcast(b, src=0),
    "all_reduce": lambda: dist.all_reduce(b),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(o, b),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(o, b),
    "barrier": lambda: dist.barrier(),
    "reduce": lambda: dist.reduce(b, dst=0),
}
f = calls[op]
f()
for _ in range(n):
    f()
dist.destroy_process_group()
