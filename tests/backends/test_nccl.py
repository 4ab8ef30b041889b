"""The nccl backend: a clear error where it cannot run; CUDA tensors where it can."""
import ctypes
import shutil
import subprocess
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings

import collectives as dist
from collectives.backends import nccl
from tests.support.profiles import examples
from tests.support.collective_cases import check, run_case
from tests.support.ranks import backend_pool
from tests.api.test_collectives import MOVING, REDUCING, SHAPES, cases

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not nccl.is_available(),
                               reason="needs a CUDA device and libnccl (none on this machine)")


def test_availability_agrees_with_the_front_end():
    assert dist.is_nccl_available() == nccl.is_available()


@pytest.mark.skipif(nccl.is_available(), reason="NCCL is available here; the error path is not reachable")
def test_asking_for_nccl_without_a_gpu_names_what_is_missing():
    with pytest.raises(RuntimeError, match="nccl backend needs"):
        nccl.create_nccl_backend(dist.HashStore(), 0, 1, 10.0)


def test_the_reduction_table_agrees_with_the_checked_lookup():
    """Each call reads (NCCL dtype, count, NCCL op) from a table; the checked lookup
    (``_dtype``) is its definition and names what NCCL lacks: the two agree on every
    dtype and op, and host memory is refused by both (no GPU needed)."""
    from collectives.core import dtypes as D
    from collectives.core.tensors import _PyBuffer
    be = object.__new__(nccl.NcclBackend)  # no communicator: these read only the tables
    for dtype in D.DTYPE_NAMES:
        for op in D.OP_NAMES:
            for device in (0, -1):
                buf = _PyBuffer(4096, 3, dtype, device)
                got = want = None
                try:
                    want = be._dtype(buf, op)
                except ValueError as e:
                    want = str(e)
                try:
                    got = be._reduction(buf, op)
                except ValueError as e:
                    got = str(e)
                assert got == want, (D.DTYPE_NAMES[dtype], D.OP_NAMES[op], device)


_RECORDING_NCCL = r"""
#include <stddef.h>
#include <stdint.h>
uintptr_t g[8];
int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *c, void *st) {
    g[0] = (uintptr_t)s; g[1] = (uintptr_t)r; g[2] = n; g[3] = dt; g[4] = op;
    g[5] = (uintptr_t)c; g[6] = (uintptr_t)st; return 3; }
int ncclReduce(const void *s, void *r, size_t n, int dt, int op, int root, void *c, void *st) {
    g[0] = (uintptr_t)s; g[1] = (uintptr_t)r; g[2] = n; g[3] = dt; g[4] = op; g[5] = root;
    g[6] = (uintptr_t)c; g[7] = (uintptr_t)st; return 0; }
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *c, void *st) {
    g[0] = (uintptr_t)s; g[1] = (uintptr_t)r; g[2] = n; g[3] = dt; g[4] = (uintptr_t)c;
    g[5] = (uintptr_t)st; return 0; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stand-in libnccl")
@pytest.mark.parametrize("by_address", [True, False], ids=["by-address", "ctypes"])
def test_nccl_entry_points_get_every_argument_whole(tmp_path, monkeypatch, by_address):
    """The collectives call NCCL by address (collectives.engines._ncclcall) or through ctypes:
    a stand-in library records what it was given (64-bit pointers and counts, a NULL
    communicator) and its return code comes back (no GPU needed)."""
    if by_address and nccl._ncclcall is None:
        pytest.skip("collectives.engines._ncclcall is not built")
    src, so = tmp_path / "rec.c", tmp_path / "librec.so"
    src.write_text(_RECORDING_NCCL)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    lib = ctypes.CDLL(str(so))
    if not by_address:
        monkeypatch.setattr(nccl, "_ncclcall", None)
        nccl._set_argtypes(lib)
    g = (ctypes.c_uint64 * 8).in_dll(lib, "g")
    ptr, comm = 0x7FFF12345678, 0x5555AAAA0000
    assert nccl._entry(lib, "ncclAllReduce", 7)(ptr, ptr + 8, 2**33 + 5, 7, 2, comm, 0x1000) == 3
    assert list(g[:7]) == [ptr, ptr + 8, 2**33 + 5, 7, 2, comm, 0x1000]
    assert nccl._entry(lib, "ncclReduce", 8)(ptr, ptr, 9, 1, 3, 1, None, 0x2000) == 0
    assert list(g[:8]) == [ptr, ptr, 9, 1, 3, 1, 0, 0x2000]
    assert nccl._entry(lib, "ncclAllGather", 6)(ptr, ptr + 64, 16, 0, comm, 0x3000) == 0
    assert list(g[:6]) == [ptr, ptr + 64, 16, 0, comm, 0x3000]


def test_the_unique_id_travels_whole_though_it_holds_nul_bytes():
    """Rank 0's id went through the store cut at its first NUL byte (a c_char array field
    reads as a C string), so every NCCL group of more than one rank hung in its setup."""
    import ctypes
    raw = bytes([2, 0, 0x1F, 0x90, 127, 0, 0, 1] + list(range(120)))
    uid = nccl._UniqueId()
    ctypes.memmove(ctypes.byref(uid), raw, len(raw))
    assert uid.raw() == raw and len(uid.raw()) == 128


def test_the_config_has_ncclconfig_v21700s_layout():
    """size_t size; unsigned magic, version; int blocking, cgaClusterSize, minCTAs, maxCTAs;
    const char *netName: NCCL reads a config by the size and version it carries."""
    import ctypes
    c = nccl._nonblocking_config()
    assert ctypes.sizeof(c) == c.size == 40
    assert nccl._Config.netName.offset == 32 and nccl._Config.blocking.offset == 16
    assert (c.magic, c.version, c.blocking, c.minCTAs) == (0xCAFEBEEF, 21700, 0, -2**31)


@needs_gpu
@pytest.mark.timeout(120)
def test_single_rank_collectives_on_cuda_tensors():
    import torch
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        t = torch.arange(10, dtype=torch.float32, device="cuda")
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        out = torch.empty(10, device="cuda")
        dist.all_gather_into_tensor(out, t)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.arange(10, dtype=torch.float32))
        h = torch.ones(4, dtype=torch.bfloat16, device="cuda")
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        assert h.cpu().tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


# ---- several ranks on CUDA tensors (ranks may share one GPU: see tests/support/ranks.py) --------------

NCCL_DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128",
               "int8", "uint8", "int32", "int64", "bool"]
NCCL_OPS = {"float": ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"],
            "complex": ["SUM", "AVG", "PREMUL_SUM"],  # NCCL reduces complex as pairs of reals
            "int": ["SUM", "PRODUCT", "MIN", "MAX"], "bool": ["SUM", "PRODUCT", "MIN", "MAX"]}


def nccl_cases():
    """Every collective on CUDA tensors, worlds 1-4, NCCL's dtypes and ops."""
    return cases(REDUCING + MOVING, max_world=4, dtypes=NCCL_DTYPES, ops=NCCL_OPS, libs=("cuda",),
                 shapes=SHAPES + [(1000,)])


@needs_gpu
@pytest.mark.timeout(900)
@settings(max_examples=examples(40), deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(wc=nccl_cases())
def test_every_collective_on_cuda_tensors_matches_numpy(wc):
    world, case = wc
    results = backend_pool("nccl", world).run(run_case, case, timeout=120)
    check(case, results, world)


def _mixups(ctx):
    """Tensors on the wrong device for a group raise ValueError before any communication;
    objects and point-to-point go through the nccl group."""
    import torch

    import collectives as dist
    out = {}
    if "gloo" not in ctx.state:
        ctx.state["gloo"] = dist.new_group(backend="gloo")
    gloo = ctx.state["gloo"]
    cuda = torch.ones(3, device="cuda")
    for what, call in [
            ("cuda_to_gloo", lambda: dist.all_reduce(cuda, group=gloo)),
            ("cuda_to_gloo_gather", lambda: dist.all_gather([torch.empty(3, device="cuda")
                                                             for _ in range(ctx.world_size)],
                                                            cuda, group=gloo)),
            ("cpu_to_nccl", lambda: dist.all_reduce(torch.ones(3))),
            ("cpu_to_nccl_broadcast", lambda: dist.broadcast(torch.ones(3), 0)),
            ("mixed_list", lambda: dist.all_gather([torch.empty(3)] + [torch.empty(3, device="cuda")
                                                                       for _ in range(ctx.world_size - 1)],
                                                   cuda))]:
        try:
            call()
            out[what] = "no error"
        except ValueError as e:
            out[what] = str(e)
    t = torch.full((4,), float(ctx.rank + 1))
    dist.all_reduce(t, group=gloo)  # the gloo group still works
    out["gloo_sum"] = t.tolist()
    objs = [None] * ctx.world_size
    dist.all_gather_object(objs, {"rank": ctx.rank})
    out["objects"] = objs
    lst = ["from root", ctx.rank] if ctx.rank == 0 else [None, None]
    dist.broadcast_object_list(lst, 0)
    out["broadcast_objects"] = lst
    nxt, prv = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    send = torch.full((5,), float(ctx.rank), device="cuda")
    recv = torch.empty(5, device="cuda")
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)])
    for r in reqs:
        r.wait()
    out["ring"] = recv.tolist()
    if ctx.rank == 0:
        dist.send_object_list([{"x": 1}], dst=1)
    elif ctx.rank == 1:
        got = [None]
        dist.recv_object_list(got, src=0)
        out["p2p_object"] = got
    return out


@needs_gpu
@pytest.mark.timeout(300)
def test_tensors_on_the_wrong_device_raise_and_objects_travel_through_nccl():
    n = 3
    res = backend_pool("nccl", n).run(_mixups, timeout=120)
    for r, out in enumerate(res):
        assert "takes CPU tensors" in out["cuda_to_gloo"], out
        assert "takes CPU tensors" in out["cuda_to_gloo_gather"], out
        assert "CUDA" in out["cpu_to_nccl"], out
        assert "CUDA" in out["cpu_to_nccl_broadcast"], out
        assert "one device" in out["mixed_list"], out
        assert out["gloo_sum"] == [6.0] * 4
        assert out["objects"] == [{"rank": q} for q in range(n)]
        assert out["broadcast_objects"] == ["from root", 0]
        assert out["ring"] == [float((r - 1) % n)] * 5
    assert res[1]["p2p_object"] == [{"x": 1}]


PEER_DIES = r"""
import os, sys, time
rank = int(os.environ["RANK"])
os.environ["NCCL_HOSTID"] = f"peer-dies-{rank}"
import torch
import collectives as dist
from datetime import timedelta
torch.cuda.set_device(0)
mode = sys.argv[1]
dist.init_process_group("nccl", timeout=timedelta(seconds=5))
t = torch.ones(1 << 16, device="cuda")
if mode != "before_first":
    dist.all_reduce(t)
    torch.cuda.synchronize()
if rank == 1:
    os._exit(0)
time.sleep(1)
start = time.monotonic()
try:
    if mode == "watchdog":
        dist.all_reduce(t)          # enqueued; nobody waits: the watchdog must abort it
        torch.cuda.synchronize()    # returns once the communicator is aborted
        dist.all_reduce(t)          # the next call raises
    else:
        dist.all_reduce(t, async_op=True).wait()
    print("NO ERROR", flush=True)
except dist.DistBackendError as e:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {e}", flush=True)
"""


@pytest.mark.faults
@needs_gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["before_first", "after_first", "watchdog"])
def test_a_dead_peer_makes_the_survivor_raise_within_the_timeout(tmp_path, mode):
    import os
    import subprocess
    import sys

    from tests.support.ranks import ROOT, free_port
    script = tmp_path / "peer.py"
    script.write_text(PEER_DIES)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               NCCL_SOCKET_IFNAME="lo", PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, str(script), mode], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert "RAISED after" in outs[0], outs[0]
    secs = float(outs[0].split("RAISED after ")[1].split(" s")[0])
    assert secs < 15, outs[0]
