"""Instructions per call of the mpi and nccl backends (callgrind), load-insensitive.

Latency on the shared 2-core VM swings with the other processes; callgrind's instruction
counts of the calling thread do not. Each figure is (instructions of N calls - of 0 calls)
/ N, world 1, one float32 (4 B), the calling thread only (``--separate-threads=yes``,
file ``*-01``), ``PYTHONHASHSEED=0``:

- ``raw``: mpi4py alone (``comm.Allreduce(MPI.IN_PLACE, b)``, ...), the anchor of the mpi
  backend, in a singleton MPI world (no mpiexec).
- ``mpi``: ``collectives`` with ``init_process_group('mpi')`` (front end, dispatcher,
  backend, mpi4py, MPICH), same calls through ``dist.*``.
- ``mpi-backend``: the backend's methods called directly (``be.all_reduce(buf, SUM)``), so
  ``mpi - mpi-backend`` is the front end's share.
- ``nccl``: the nccl backend with CUDA and NCCL faked at the lowest level: libnccl is a C
  library whose functions return ncclSuccess at once (compiled here from
  ``_FAKE_NCCL_C``, loaded through ``COLLECTIVES_NCCL_LIB``), and torch's CUDA entry points
  the backend reaches are faked at torch's C level only (see ``_fake_cuda``): torch's own
  Python around them (``Event.__new__``, ``Event.record``, ``current_stream``,
  ``Stream.__new__``) runs as it does on a GPU build. A call goes through the group's
  dispatcher as the front end hands it over (``pg.dispatch.call``: torch's CPU build here
  cannot make a CUDA tensor, so the front-end function's planning is left out); the
  buffer says device 0. The
  stand-ins' own instructions are counted: compare trees, not against a GPU.

Usage::

    python bench/callgrind_backends.py --measure [--impls raw,mpi,nccl] [--ops ...] [--n 5000]
    python bench/callgrind_backends.py IMPL OP N     # one run (what --measure runs under valgrind)
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

OPS = ("all_reduce", "broadcast", "all_gather", "barrier", "reduce_scatter")

_FAKE_NCCL_C = r"""
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetUniqueId(ncclUniqueId *u) { memset(u, 0, sizeof *u); return 0; }
int ncclCommInitRankConfig(void **comm, int n, ncclUniqueId u, int r, void *cfg) {
    *comm = (void *)1; return 0; }
int ncclCommGetAsyncError(void *comm, int *state) { *state = 0; return 0; }
int ncclCommAbort(void *comm) { return 0; }
int ncclCommDestroy(void *comm) { return 0; }
const char *ncclGetErrorString(int c) { return "fake"; }
const char *ncclGetLastError(void *comm) { return ""; }
int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *comm, void *st) { return 0; }
int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, void *comm, void *st) { return 0; }
int ncclReduce(const void *s, void *r, size_t n, int dt, int op, int root, void *comm, void *st) { return 0; }
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *comm, void *st) { return 0; }
int ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, void *comm, void *st) { return 0; }
int ncclSend(const void *s, size_t n, int dt, int peer, void *comm, void *st) { return 0; }
int ncclRecv(void *r, size_t n, int dt, int peer, void *comm, void *st) { return 0; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
"""


def _fake_cuda():
    """torch's CUDA layer with only its C level faked: its Python (``Event.__new__``,
    ``Event.record``, ``current_stream``, ``Stream.__new__``) runs as on a GPU build; the
    C extension's entry points it reaches (the event and stream base classes,
    ``_cuda_getCurrentStream``, ``_cuda_getCurrentRawStream``) are minimal stand-ins."""
    import torch
    import torch.cuda.streams as S

    class EventBase:
        def __new__(cls, **kwargs):
            return object.__new__(cls)

        def record(self, stream):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

    class StreamBase:
        cuda_stream = 0x1000

        def __new__(cls, **kwargs):
            return object.__new__(cls)

    S.Event.__bases__ = (EventBase,)
    S.Stream.__bases__ = (StreamBase,)
    torch.cuda._initialized = True
    torch.backends.cuda.is_built = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    stream = (0, 0, 1)  # (stream_id, device_index, device_type)
    torch._C._cuda_getCurrentStream = lambda device: stream
    torch._C._cuda_getCurrentRawStream = lambda device: 0x1000  # the backend before 2026-11-27
    ones = torch.ones
    torch.ones = lambda *shape, device=None, **kw: ones(*shape, **kw)  # barrier's scratch


def _fake_nccl_lib(tmp):
    src = os.path.join(tmp, "fake_nccl.c")
    lib = os.path.join(tmp, "libfakenccl.so")
    with open(src, "w") as f:
        f.write(_FAKE_NCCL_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def one(impl, op, n):
    """Set up ``impl``, call ``op`` once, then ``n`` times (what valgrind measures)."""
    import numpy as np
    if impl == "raw":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        b = np.ones(1, np.float32)
        o = np.ones(comm.size, np.float32)
        calls = {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, b),
                 "broadcast": lambda: comm.Bcast(b, root=0),
                 "all_gather": lambda: comm.Allgather(b, o),
                 "reduce_scatter": lambda: comm.Reduce_scatter_block(o, b),
                 "barrier": lambda: comm.Barrier()}
        fini = None
    else:
        import collectives as dist
        from collectives.core import dtypes as D
        from collectives.store import HashStore
        if impl.startswith("mpi"):
            dist.init_process_group("mpi")
        else:
            _fake_cuda()
            dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
        b = np.ones(1, np.float32)
        o = np.ones(1, np.float32)
        fini = dist.destroy_process_group
        if impl == "mpi":
            calls = {"all_reduce": lambda: dist.all_reduce(b),
                     "broadcast": lambda: dist.broadcast(b, src=0),
                     "all_gather": lambda: dist.all_gather_into_tensor(o, b),
                     "reduce_scatter": lambda: dist.reduce_scatter_tensor(o, b),
                     "barrier": lambda: dist.barrier()}
        else:
            from collectives.core import tensors as T
            from collectives.core.world import world
            pg = world.default
            be = pg.backend
            dev = 0 if impl == "nccl" else -1
            buf = T.Buffer(b.ctypes.data, 1, D.FLOAT32, dev, b)
            out = T.Buffer(o.ctypes.data, 1, D.FLOAT32, dev, o)
            if impl == "nccl":
                call = pg.dispatch.call
                calls = {
                    "all_reduce": lambda: call("all_reduce", buf, -1, D.SUM, be.all_reduce,
                                               (buf, D.SUM)),
                    "broadcast": lambda: call("broadcast", buf, 0, -1, be.broadcast, (buf, 0)),
                    "all_gather": lambda: call("all_gather_into_tensor", buf, -1, -1,
                                               be.all_gather, (out, buf)),
                    "reduce_scatter": lambda: call("reduce_scatter_tensor", out, -1, D.SUM,
                                                   be.reduce_scatter, (out, buf, D.SUM)),
                    "barrier": lambda: call("barrier", None, -1, -1, be.barrier, ())}
            else:  # mpi-backend
                calls = {"all_reduce": lambda: be.all_reduce(buf, D.SUM),
                         "broadcast": lambda: be.broadcast(buf, 0),
                         "all_gather": lambda: be.all_gather(out, buf),
                         "reduce_scatter": lambda: be.reduce_scatter(out, buf, D.SUM),
                         "barrier": lambda: be.barrier()}
    f = calls[op]
    f()
    for _ in range(n):
        f()
    if fini is not None:
        fini()


def _instructions(path):
    with open(path) as fh:
        for line in fh:
            m = re.match(r"(?:summary|totals):\s+(\d+)", line)
            if m:
                return int(m.group(1))
    raise RuntimeError(f"no totals in {path}")


def measure(impl, op, n, tmp, env):
    got = []
    for k in (0, n):
        base = os.path.join(tmp, f"cg.{impl}.{op}.{k}")
        subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes",
                        f"--callgrind-out-file={base}.%p", sys.executable, __file__, impl, op,
                        str(k)], check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        got.append(_instructions(glob.glob(base + ".*-01")[0]))
    return (got[1] - got[0]) / n


def main():
    if len(sys.argv) == 4 and not sys.argv[1].startswith("-"):
        return one(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", required=True)
    ap.add_argument("--impls", default="raw,mpi,mpi-backend,nccl")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather,barrier")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONHASHSEED="0")
        if "nccl" in a.impls:
            env["COLLECTIVES_NCCL_LIB"] = _fake_nccl_lib(tmp)
        for impl in a.impls.split(","):
            for op in a.ops.split(","):
                row = {"impl": impl, "op": op, "instructions_per_call": round(
                    measure(impl, op, a.n, tmp, env)), "label": a.label}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
