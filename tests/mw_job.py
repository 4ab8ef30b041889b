"""A master-worker job for tests: every rank runs this module; the master serves calls
from the test process (functions of this module, by name), the other ranks are workers.

    python -m tests.mw_job            # env: RANK, WORLD_SIZE, MASTER_ADDR/PORT,
                                      # MW_TEST_ADDR, MW_TEST_KEY (the test's listener)

Also the scripts of the lifecycle tests: ``python -m tests.mw_job <scenario>``.
"""
import operator
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Client

import numpy as np

import collectives as dist
import collectives.master_worker as mw


# ---- functions registered on every rank (before init_master_worker) --------------------------
@mw.register_function
def scale_(t, k):
    t *= k
    return None


@mw.register_function
def add_arrays(a, b):
    return a + b


@mw.register_function
def describe(x, *, extra=None):
    return {"kind": type(x).__name__, "extra": extra}


@mw.register_function
def boom(msg):
    raise RuntimeError(msg)


@mw.register_function
def make_range(n):
    return np.arange(n, dtype=np.float64)


_REMOTE_BIN = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
               "maximum": lambda x, o: x.maximum(o), "minimum": lambda x, o: x.minimum(o),
               "eq": operator.eq, "lt": operator.lt, "ge": operator.ge}


# ---- the op-sequence interpreter: the same program on NumPy arrays and on remote tensors ------
def interpret(prog, a, b, remote):
    """Run ``prog`` (a list of (op, arg)) on ``a``, with ``b`` as the second operand;
    ``remote`` says whether a and b are RemoteTensors (else NumPy arrays)."""
    x = a
    for op, arg in prog:
        if op in ("add", "sub", "mul", "maximum", "minimum", "eq", "lt", "ge"):
            other = b if arg is None else arg
            if remote:
                x = _REMOTE_BIN[op](x, other)
            else:
                x = np.asarray({"add": np.add, "sub": np.subtract, "mul": np.multiply,
                                "maximum": np.maximum, "minimum": np.minimum, "eq": np.equal,
                                "lt": np.less, "ge": np.greater_equal}[op](x, other))
        elif op == "rsub":
            x = arg - x if remote else np.asarray(np.subtract(arg, x))
        elif op in ("neg", "abs", "square"):
            x = getattr(x, op)() if remote else np.asarray(
                getattr(np, {"neg": "negative"}.get(op, op))(x))
        elif op in ("sum", "max", "min", "prod"):
            dim, keep = arg
            x = getattr(x, op)(dim, keep) if remote else np.asarray(
                getattr(np, op)(x, axis=dim, keepdims=keep))
        elif op == "reshape_flat":
            x = x.reshape(-1) if remote else x.reshape(-1)
        elif op == "t":
            x = x.t() if remote else x.T
        elif op == "getitem":
            x = x[arg]
            x = x if remote else np.asarray(x)
        elif op == "clone":
            x = x.clone() if remote else x.copy()
        elif op == "astype":
            x = x.to(arg) if remote else x.astype(arg)
        elif op == "fill_":
            if remote:
                x.fill_(arg)
            else:
                x[...] = arg
        elif op in ("add_", "mul_"):
            if remote:
                getattr(x, op)(arg)
            else:
                x = np.asarray(x)
                if op == "add_":
                    x += arg
                else:
                    x *= arg
        else:
            raise ValueError(op)
    return x


# ---- cases run on the master --------------------------------------------------------------------
def run_program(a, b, prog, node=0):
    ra, rb = mw.send(a, node=node), mw.send(b, node=node)
    return interpret(prog, ra, rb, True).numpy()


def binary(a, b, op, node=0):
    ra, rb = mw.send(a, node=node), mw.send(b, node=node)
    return interpret([(op, None)], ra, rb, True).numpy()


def echo(a, node=0):
    return mw.send(a, node=node).numpy()


def seed_example():
    """The seed's master-worker example, adapted (no CUDA here)."""
    x = dist.FloatTensor(20, 20).fill_(4)
    ylocal = np.random.default_rng(0).standard_normal((20, 20)).astype(np.float32)
    y = dist.dist_send(ylocal)
    z = x + y
    out = {"z": (z.get_node(), z.get_device()), "z_val": z.numpy(), "y": ylocal}
    with dist.node(1):
        a = dist.FloatTensor(10)
        out["a"] = (a.get_node(), a.get_device())
    return out


def misc_values(a, b):
    """Indexing, assignment, matmul, transposes, moves between nodes, metadata."""
    ra, rb = mw.send(a, node=0), mw.send(b, node=0)
    out = {}
    out["getitem"] = ra[1:, ::2].numpy()
    out["fancy"] = ra[np.array([0, 2])].numpy()
    out["mask"] = ra[ra > 0].numpy()
    out["matmul"] = (ra @ rb).numpy()
    out["t_matmul"] = (ra.t() @ ra).numpy()
    out["reshape"] = ra.reshape(2, -1).view(-1, 2).numpy()
    out["permute"] = ra.reshape(3, 2, 2).permute(2, 0, 1).numpy()
    out["unsq"] = ra.unsqueeze(0).squeeze(0).shape
    out["rows"] = [row.numpy() for row in ra]
    c = ra.clone()
    c[0] = 7.0
    c[1:, 1] = rb[:2, 0]
    c += 1
    out["setitem"] = c.numpy()
    out["orig"] = ra.numpy()
    moved = ra.to_node(1)
    out["moved"] = (moved.get_node(), (moved * 2).numpy())
    out["meta"] = (ra.shape, str(ra.dtype), ra.ndim, ra.numel(), len(ra), ra.size(1))
    out["lazy_meta"] = ((ra @ rb).shape, (ra > 0).dtype.name)
    out["reduce"] = (ra.sum().item(), ra.mean(1).numpy(), ra.max(0, True).numpy(),
                     ra.argmax(1).numpy(), ra.std().item(), ra.var(0, correction=0).numpy())
    out["unary"] = (ra.exp().numpy(), (-ra).relu().numpy(), ra.clamp(-0.5, 0.5).numpy(),
                    (ra > 0).where(ra, 0.0).numpy())
    out["scalar_left"] = ((2.0 - ra) / 4).numpy()
    z = mw.zeros(3, dtype="int64", node=1)
    z.fill_(5).mul_(3).sub_(1)
    out["inplace_chain"] = z.numpy()
    out["typed"] = [(f.__name__, f(2, node=1).numpy().dtype.name) for f in (
        dist.FloatTensor, dist.DoubleTensor, dist.HalfTensor, dist.LongTensor, dist.IntTensor,
        dist.ShortTensor, dist.CharTensor, dist.ByteTensor, dist.BoolTensor)]
    out["from_data"] = dist.FloatTensor([1, 2, 3]).numpy()
    out["full"] = mw.full((2, 2), 9, dtype="int16").numpy()
    mw.manual_seed(3)
    r1 = mw.rand(1000, node=0).numpy()
    mw.manual_seed(3)
    r2 = mw.rand(1000, node=0).numpy()
    out["rand"] = (bool((r1 == r2).all()), float(r1.min()), float(r1.max()))
    return out


def torch_case():
    """torch mode: get() is a torch tensor; the seed's .dist_send() method, opted in."""
    import torch
    mw.enable_dist_send()
    t = torch.tensor([1.0, 2.0]).dist_send(node=0)
    local = (t * 2).get()
    return type(local).__name__, local.tolist(), (t.to_node(1) + 1).get_node(), str(t.dtype)[6:]


def cuda_case():
    """torch mode on workers with a GPU: .cuda() makes a device tensor on the node that holds
    the data, operations run there, get() copies back to the master's CPU."""
    import torch
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    r = mw.send(a, node=0)
    g = r.cuda()
    h = (g * 2 + 1).sum(0)
    back = h.get()
    return (r.get_device(), g.get_device(), h.get_device(), g.get_node(), back.device.type,
            back.tolist(), g.cpu().get_device())


def call(fn_name, *args):
    """Any attribute path of ``mw`` / ``dist`` for small checks, e.g. ('mw.num_nodes',)."""
    obj = {"mw": mw, "dist": dist, "np": np}[fn_name.split(".")[0]]
    for part in fn_name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj(*args)


def expect_error(fn_name, *args):
    """(type name, message) of what ``fn_name(*args)`` raises, or None."""
    try:
        globals()[fn_name](*args)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


# small scenarios for expect_error
def cross_node_operands():
    return mw.ones(2, node=0) + mw.ones(2, node=1)


def local_operand():
    return mw.ones(2) + np.ones(300_000)  # past LOCAL_MAX: small ones travel by value


def unknown_node():
    return mw.ones(2, node=99)


def freed_handle():
    x = mw.ones(2)
    x.free()
    return x + 1


def bad_dtype():
    return mw.zeros(2, dtype="float128")


def bad_shape():
    return mw.zeros(-1)


def init_pg_again():
    dist.init_process_group("gloo")


def init_mw_again():
    dist.init_master_worker()


def worker_error_at_sync():
    """A shape error on node 1 surfaces at the next sync point, naming node and command;
    the result is then failed; later ops on it refuse; the node still works."""
    a, b = mw.ones(3, 4, node=1), mw.ones(5, 6, node=1)
    c = a @ b            # queued: no error yet
    d = c + 1            # depends on a failed result
    out = {}
    try:
        mw.synchronize(1)
    except mw.RemoteError as e:
        out["sync"] = (e.node, e.command, str(e), len(e.errors))
    try:
        c + 1
    except RuntimeError as e:
        out["after"] = str(e)
    try:
        d.numpy()
    except Exception as e:
        out["dependent"] = (type(e).__name__, str(e))
    out["still_works"] = (mw.ones(2, node=1) * 3).numpy()
    return out


def events_and_sync():
    x = mw.zeros(1000, node=0)
    for _ in range(50):
        x += 1
    ev = mw.Event().record(0)
    ev.wait()
    q = ev.query()
    mw.synchronize()
    return q, x.numpy()


def collectives_case(arrays, op):
    ts = [mw.send(a, node=k) for k, a in enumerate(arrays)]
    if op == "broadcast":
        mw.broadcast(ts, src=1)
        return [t.numpy() for t in ts]
    if op == "all_gather":
        return [g.numpy() for g in mw.all_gather(ts)]
    mw.all_reduce(ts, op=op)
    return [t.numpy() for t in ts]


def collective_with_failed_input():
    """An all_reduce whose input failed on one node: both nodes report it, quickly."""
    bad = mw.ones(2, 2, node=1) @ mw.ones(3, 3, node=1)   # fails on node 1
    good = mw.ones(4, node=0)
    t0 = time.perf_counter()
    mw.all_reduce([good, bad])
    out = {}
    for k in (0, 1):
        try:
            mw.synchronize(k)
            out[k] = None
        except mw.RemoteError as e:
            out[k] = str(e)
    out["secs"] = time.perf_counter() - t0
    a, b = mw.ones(3, node=0), mw.ones(3, node=1) * 2    # the nodes still work
    out["after"] = (a * 2).numpy().tolist(), b.numpy().tolist()
    return out


def collective_size_mismatch():
    """all_reduce over tensors of different sizes: every node fails it, none reduces."""
    a, b = mw.ones(4, node=0), mw.ones(5, node=1)
    mw.all_reduce([a, b])
    out = []
    for k in (0, 1):
        try:
            mw.synchronize(k)
            out.append(None)
        except mw.RemoteError as e:
            out.append(str(e))
    return out, a.numpy().tolist()


def rpc_case():
    out = {}
    out["sync"] = mw.rpc_sync(0, add_arrays, np.arange(3.0), np.ones(3))
    fut = mw.rpc_async(1, "describe", 5, extra=[1, "x"])
    out["async"] = fut.wait()
    t = mw.ones(4, node=1)
    mw.rpc_sync(1, scale_, t, 3.0)
    out["scaled"] = t.numpy()
    r = mw.remote(0, make_range, 5)
    out["remote"] = (r.get_node(), (r * 2).numpy())
    try:
        mw.rpc_sync(0, boom, "kaput")
    except mw.RemoteError as e:
        out["boom"] = str(e)
    try:
        mw.rpc_sync(0, print, "x")
    except ValueError as e:
        out["unregistered"] = str(e)
    try:
        mw.rpc_sync(0, "describe", object())
    except ValueError as e:
        out["not_plain"] = str(e)
    return out


def big_frames(n):
    """Commands and replies larger than one frame (the continuation messages)."""
    a, b = np.arange(n, dtype=np.float64), np.ones(n)
    r = mw.rpc_sync(1, add_arrays, a, b)          # a big command and a big reply
    t = mw.send(a, node=1)
    idx = np.arange(0, n, 3)
    picked = t[idx].numpy()                        # a big index array in the command
    return r, picked


def leak_case(n):
    before = mw.worker_stats(0)
    t0 = time.perf_counter()
    for i in range(n):
        x = mw.ones(64, node=0)
        y = x + i          # two handles per iteration, dropped at once
        del x, y
    mw.synchronize(0)
    after = mw.worker_stats(0)
    return before, after, time.perf_counter() - t0


def kill_worker_midstream(k):
    """Kill node k's process while commands stream to it; what the master sees."""
    pid = mw.master.get_master().node(k).pid
    x = mw.ones(1000, node=k)
    for _ in range(100):
        x += 1
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        for _ in range(1000):
            x += 1
        x.numpy()
    except Exception as e:
        return type(e).__name__, str(e), time.perf_counter() - t0
    return None


def pids():
    return [nd.pid for nd in mw.master.get_master().nodes]


# ---- entry points ------------------------------------------------------------------------------------
def serve_tests():
    """The master's loop: run the test process's calls until it says stop."""
    addr, port = os.environ["MW_TEST_ADDR"].rsplit(":", 1)
    conn = Client((addr, int(port)), authkey=bytes.fromhex(os.environ["MW_TEST_KEY"]))
    while True:
        req = conn.recv()
        if req is None:
            break
        name, args = req
        try:
            conn.send(("ok", globals()[name](*args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    conn.close()


def main():
    scenario = sys.argv[1] if len(sys.argv) > 1 else "serve"
    library = os.environ.get("MW_TEST_LIBRARY") or None
    backend = os.environ.get("MW_TEST_BACKEND", "tcp")
    dist.init_master_worker(backend=backend, timeout=float(os.environ.get("MW_TEST_TIMEOUT", "30")),
                            library=library)
    # only the master gets here
    if scenario == "serve":
        serve_tests()
    elif scenario == "seed":
        out = seed_example()
        ok = np.allclose(out["z_val"], 4 + out["y"]) and out["z"] == (0, -1) and out["a"] == (1, -1)
        print("SEED", "OK" if ok else "WRONG", out["z"], out["a"], flush=True)
    elif scenario == "exit":            # the master ends normally
        print("PIDS", *pids(), flush=True)
        (mw.ones(3) + 1).numpy()
    elif scenario == "crash":           # the master dies without cleanup
        print("PIDS", *pids(), flush=True)
        mw.ones(3) + 1
        os._exit(3)
    elif scenario == "raise":           # an exception ends the master's program
        print("PIDS", *pids(), flush=True)
        raise SystemExit("master gives up")
    elif scenario == "hang":            # the master waits to be signalled
        print("PIDS", *pids(), flush=True)
        time.sleep(120)


if __name__ == "__main__":
    main()
