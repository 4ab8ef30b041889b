"""A master-worker job for tests: every rank runs this module; the master serves calls
from the test process (functions of this module, by name), the other ranks are workers.

    python -m tests.master_worker.mw_job            # env: RANK, WORLD_SIZE, MASTER_ADDR/PORT,
                                      # MW_TEST_ADDR, MW_TEST_KEY (the test's listener)

Also the scripts of the lifecycle tests: ``python -m tests.master_worker.mw_job <scenario>``.
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


# ---- issue 42: torch and NumPy through their own dispatch ---------------------------------------
def _to_local(v):
    if isinstance(v, mw.RemoteTensor):
        return v.get()
    if isinstance(v, (list, tuple)):
        return tuple(_to_local(x) for x in v)
    return v


def _common_calls(a, b, m, tgt, torch, F):
    """The issue's list of common calls, spelled as a torch user writes them."""
    return {
        "sum": a.sum(), "mean": a.mean(), "sum_dim": a.sum(1, keepdim=True),
        "exp": torch.exp(a), "matmul": torch.matmul(a, b), "cat": torch.cat([a, a]),
        "where": torch.where(m, a, 0.0), "einsum": torch.einsum("ij,jk->ik", a, b),
        "zeros_like": torch.zeros_like(a), "relu": F.relu(a), "linear": F.linear(a, b.t()),
        "cross_entropy": F.cross_entropy(a, tgt), "softmax": a.softmax(1),
        "log_softmax": a.log_softmax(1), "pow": a.pow(2), "norm": a.norm(),
        "cumsum": a.cumsum(1), "topk": a.topk(2), "sort": a.sort(1),
        "expand": a[:, :1].expand(4, 3), "repeat": a.repeat(2, 1),
        "masked_fill": a.masked_fill(m, -1.0), "index_select": a.index_select(1, tgt),
        "new_ones": a.new_ones(2, 3), "max_dim": a.max(dim=1), "min_dim": a.min(1),
        "unique": torch.unique(tgt, return_counts=True),
        "svd": torch.linalg.svd(a, full_matrices=False), "split": torch.split(a, 2),
        "dim": a.dim(), "size": tuple(a.size()), "shape": tuple(a.shape),
        "item": a.sum().item(), "t": a.t(), "T": a.T, "getitem": a[1:, ::2],
        "argmax": a.argmax(1), "clamp": a.clamp(-0.5, 0.5), "std": a.std(1),
        "var_mean": torch.var_mean(a, 1), "layer_norm": F.layer_norm(a, (5,)),
        "dropout_eval": F.dropout(a, 0.5, training=False), "radd": 1 + a, "rsub": 1 - a,
        "rtruediv": 1 / (a.abs() + 1), "neg": -a, "abs": abs(a), "to_double": a.to(torch.float64),
        "gelu": F.gelu(a), "stack": torch.stack([a, a], 1), "flatten": torch.flatten(a),
        "chunk": a.chunk(2), "tanh_method": a.tanh(), "mul_local": a * torch.arange(5.0),
        "argsort": torch.argsort(a, 1), "mse": F.mse_loss(a, a * 2),
        "pow_op": a ** 2, "rpow": 2 ** a, "ipow": _ipow(a * 1, None),
        "np_concatenate": np.concatenate([a, a]), "np_stack": np.stack([a, a], 1),
        "np_vstack": np.vstack([a, a]), "np_hstack": np.hstack([a, a]),
    }


def torch_common_calls():
    """{name: (same as local?, detail)} for the common calls, remote vs local."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 5, generator=g), torch.randn(5, 3, generator=g)
    m, tgt = a > 0, torch.tensor([0, 2, 1, 4])
    want = _common_calls(a, b, m, tgt, torch, F)
    ra, rb, rm, rt = (mw.send(x, node=1) for x in (a, b, m, tgt))
    got = _common_calls(ra, rb, rm, rt, torch, F)
    out = {}
    for k, w in want.items():
        gv = _to_local(got[k])
        try:
            torch.testing.assert_close(gv, tuple(w) if isinstance(w, tuple) else w,
                                       rtol=0, atol=0)
            out[k] = (True, type(got[k]).__name__)
        except Exception as e:
            out[k] = (False, f"{type(got[k]).__name__}: {str(e)[:200]}")
    return out


def result_kinds():
    """What remote calls give back: named tuples with torch's fields, values, shapes."""
    import torch
    t = mw.send(torch.arange(12.0).reshape(3, 4), node=0)
    mx = t.max(dim=1)
    sv = torch.linalg.svd(t)
    return {"max": (type(mx).__name__, type(mx).__module__, type(mx).__match_args__,
                    type(mx.values).__name__, mx.indices.get().tolist()),
            "svd_fields": type(sv).__match_args__, "split": [type(s).__name__ for s in torch.split(t, 1)],
            "dim": t.dim(), "shape": (type(t.shape).__name__, tuple(t.shape)),
            "lazy_shape": type((t @ t.T).shape).__name__, "numel": t.numel(),
            "is_floating_point": t.is_floating_point(), "dtype": str((t > 1).dtype),
            "device": str(t.device), "equal": torch.equal(t, t),
            "unique": [x.get().tolist() for x in torch.unique(t.long() % 3, return_counts=True)]}


def autograd_case():
    """Gradients through matmul, softmax and cross_entropy on node 1 against local ones."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 4, generator=g), torch.randn(4, 3, generator=g)
    tgt = torch.tensor([0, 1, 2, 0, 1, 2])
    lw = w.clone().requires_grad_()
    logits = torch.matmul(x, lw)
    loss = F.cross_entropy(logits.softmax(1) * 3, tgt)
    loss.backward()
    rw = mw.send(w, node=1, requires_grad=True)
    rx = mw.send(x, node=1)
    rl = F.cross_entropy(torch.matmul(rx, rw).softmax(1) * 3, tgt)
    rl.backward()
    leaf = (rw.is_leaf, rw.requires_grad, rl.requires_grad, rl.detach().requires_grad)
    return loss.item(), rl.item(), lw.grad.numpy(), rw.grad.get().numpy(), leaf


def no_grad_case():
    import torch
    w = mw.ones(3, node=0, requires_grad=True)
    with torch.no_grad():
        inside = (w * 2).requires_grad
        w.mul_(2)  # an in-place update of a leaf: allowed only under no_grad
    after = (w * 2).requires_grad
    return inside, after, w.get().tolist()


def _tiny_net(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def train_case(steps, opt_name):
    """A module and its optimizer trained on node 1 for ``steps`` steps, and locally."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
    opt_cls = getattr(torch.optim, opt_name)
    local = _tiny_net(torch)
    net = mw.to_node(_tiny_net(torch), 1)
    opt_l = opt_cls(local.parameters(), lr=0.1)
    opt_r = mw.optim(opt_cls, net.parameters(), lr=0.1)
    rx, ry = mw.send(x, node=1), mw.send(y, node=1)
    losses = []
    for _ in range(steps):
        opt_l.zero_grad()
        ll = F.cross_entropy(local(x), y)
        ll.backward()
        opt_l.step()
        opt_r.zero_grad()
        rl = F.cross_entropy(net(rx), ry)
        rl.backward()
        opt_r.step()
        losses.append((ll.item(), rl.item()))
    sd = net.state_dict()
    diff = max(float((sd[k] - v).abs().max()) for k, v in local.state_dict().items())
    return losses, diff, [p.get_node() for p in net.parameters()], sorted(sd)


def refused_case():
    """Names outside the allow-list raise on the master, before anything is sent."""
    import gc
    import io

    import torch
    t = mw.ones(2, node=0)
    # no collection in the window: a cycle of an earlier case's remote tensors freed here
    # would send its release and count as a command (seen once in a full run)
    gc.collect()
    gc.disable()
    before = mw.worker_stats(0)["seq"]
    out = {}
    for name in ("torch.save", "torch.load", "torch.hub.load", "os.system", "builtins.exec",
                 "torch.Tensor.storage", "torch.Tensor.register_hook", "torch._C._foo"):
        try:
            mw.call(name, t)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    try:
        torch.save(t, io.BytesIO())
        out["pickle"] = None
    except TypeError as e:
        out["pickle"] = str(e)
    try:
        t.register_hook(print)
        out["attr"] = None
    except AttributeError as e:
        out["attr"] = str(e)
    after = mw.worker_stats(0)["seq"]
    gc.enable()
    return out, after - before


def worker_refuses_case():
    """A name outside the list that reaches a worker anyway (a master that skipped the
    check) is refused there: the call fails, the node keeps serving."""
    from collectives.master_worker import protocol as P
    m = mw.master.get_master()
    nd = m.node(0)
    t = mw.ones(2, node=0)
    m.command(nd, P.C_CALL, ("os.system", m.new_hid(nd), ("true",), None))
    try:
        mw.synchronize(0)
        msg = None
    except mw.RemoteError as e:
        msg = (e.command, str(e))
    return msg, (t + 1).get().tolist()


def mixed_nodes_case():
    import torch
    a, b = mw.ones(2, 2, node=0), mw.ones(2, 2, node=1)
    try:
        torch.matmul(a, b)
    except ValueError as e:
        return str(e)
    return None


_UFUNC_SKIP = {"isnat", "ldexp", "frexp", "modf", "divmod", "matmul", "vecdot", "matvec",
               "vecmat", "bitwise_count"}


def numpy_ufuncs_case():
    """Every NumPy ufunc of one or two inputs and one output on remote arrays vs NumPy."""
    rng = np.random.default_rng(3)
    x = rng.uniform(0.1, 0.9, (3, 4))
    y = rng.uniform(0.1, 0.9, (3, 4))
    ix, iy = rng.integers(1, 7, (3, 4)), rng.integers(1, 7, (3, 4))
    rx, ry, rix, riy = (mw.send(v, node=0) for v in (x, y, ix, iy))
    ran, bad = [], {}
    for name in sorted(vars(np)):
        f = getattr(np, name)
        if not isinstance(f, np.ufunc) or f.nout != 1 or f.nin not in (1, 2) or name in _UFUNC_SKIP:
            continue
        for args, rargs in (((x, y), (rx, ry)), ((ix, iy), (rix, riy))):
            try:
                with np.errstate(all="ignore"):
                    want = f(*args[:f.nin])
            except TypeError:
                continue
            try:
                got = np.asarray(f(*rargs[:f.nin]).numpy())
                np.testing.assert_array_equal(got, want)
            except Exception as e:
                bad[name] = f"{type(e).__name__}: {str(e)[:200]}"
            ran.append(name)
            break
    red = mw.send(x, node=0)
    extra = {"add.reduce": (np.add.reduce(red, axis=1).numpy(), np.add.reduce(x, axis=1)),
             "multiply.accumulate": (np.multiply.accumulate(red).numpy(),
                                     np.multiply.accumulate(x)),
             "subtract.outer": (np.subtract.outer(red[0], red[1]).numpy(),
                                np.subtract.outer(x[0], x[1])),
             "local_operand": ((red + np.ones(4)).numpy(), x + 1),
             "reflected": ((np.ones(4) - red).numpy(), 1 - x)}
    for k, (g, w) in extra.items():
        if not np.array_equal(g, w):
            bad[k] = "differs"
    return sorted(set(ran)), bad


def numpy_functions_case():
    """A list of NumPy array functions on remote arrays vs NumPy."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((4, 4))
    b = rng.standard_normal((4, 4))
    ra, rb = mw.send(a, node=1), mw.send(b, node=1)
    cases = {
        "concatenate": lambda a, b: np.concatenate([a, b]), "stack": lambda a, b: np.stack([a, b]),
        "where": lambda a, b: np.where(a > 0, a, b), "sum": lambda a, b: np.sum(a, axis=0),
        "mean": lambda a, b: np.mean(a), "std": lambda a, b: np.std(a, axis=1, ddof=1),
        "cumsum": lambda a, b: np.cumsum(a, axis=1), "sort": lambda a, b: np.sort(a, axis=0),
        "argsort": lambda a, b: np.argsort(a), "transpose": lambda a, b: np.transpose(a),
        "reshape": lambda a, b: np.reshape(a, (2, 8)), "clip": lambda a, b: np.clip(a, -0.5, 0.5),
        "dot": lambda a, b: np.dot(a, b), "einsum": lambda a, b: np.einsum("ij,jk->ik", a, b),
        "tensordot": lambda a, b: np.tensordot(a, b, 1), "outer": lambda a, b: np.outer(a, b),
        "diff": lambda a, b: np.diff(a), "take": lambda a, b: np.take(a, [0, 2]),
        "max": lambda a, b: np.max(a, axis=0), "argmax": lambda a, b: np.argmax(a),
        "round": lambda a, b: np.round(a, 2), "tile": lambda a, b: np.tile(a, 2),
        "repeat": lambda a, b: np.repeat(a, 2), "flip": lambda a, b: np.flip(a),
        "roll": lambda a, b: np.roll(a, 1), "triu": lambda a, b: np.triu(a),
        "trace": lambda a, b: np.trace(a), "linalg.norm": lambda a, b: np.linalg.norm(a),
        "linalg.inv": lambda a, b: np.linalg.inv(a), "linalg.solve": lambda a, b: np.linalg.solve(a, b),
        "fft.fft": lambda a, b: np.fft.fft(a), "unique": lambda a, b: np.unique(np.round(a)),
        "split": lambda a, b: np.split(a, 2), "allclose": lambda a, b: np.allclose(a, a),
        "array_equal": lambda a, b: np.array_equal(a, b), "median": lambda a, b: np.median(a),
        "percentile": lambda a, b: np.percentile(a, 30), "cov": lambda a, b: np.cov(a),
        "kron": lambda a, b: np.kron(a[:2, :2], b[:2, :2]), "pad": lambda a, b: np.pad(a, 1),
    }
    bad, remote_kinds = {}, {}
    for k, f in cases.items():
        want = f(a, b)
        try:
            got = f(ra, rb)
            remote_kinds[k] = type(got).__name__
            gv = [g.numpy() for g in got] if isinstance(got, list) else (
                got.numpy() if isinstance(got, mw.RemoteTensor) else got)
            np.testing.assert_array_equal(np.asarray(gv), np.asarray(want))
        except Exception as e:
            bad[k] = f"{type(e).__name__}: {str(e)[:200]}"
    return sorted(cases), bad, remote_kinds


def _outcome(fn, *args):
    """("ok", NumPy array of the result) or ("err", exception type name) of ``fn(*args)``."""
    import warnings
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            r = fn(*args)
            if isinstance(r, mw.RemoteTensor):
                r = r.get()
            if isinstance(r, (list, tuple)):
                r = [x.get() if isinstance(x, mw.RemoteTensor) else x for x in r]
                return "ok", [np.asarray(x) for x in r]
            return "ok", np.asarray(r)
    except Exception as e:
        return "err", type(e).__name__


def _lib_array(a, torch_mode):
    if not torch_mode or not isinstance(a, np.ndarray):
        return a
    import torch
    return torch.from_numpy(a.copy())


def operator_case(name, form, a, b, node=0):
    """One Python operator (collectives.master_worker.operators) on a remote tensor and on
    the same local one: (local outcome, remote outcome), as _outcome gives them.

    ``form``: "forward" (``a OP b``, or ``OP a``), "reflected" (``b OP a``, ``b`` a Python
    number: the remote tensor's reflected method), "local_left" (``b OP a``, ``b`` a local
    array or tensor), "inplace" (``a OP= b``; the outcome is the tensor after it, read
    through another name bound to it before, and the name's own value must be the same)."""
    from collectives.master_worker.operators import BY_NAME
    op = BY_NAME[name]
    torch_mode = mw.master.get_master().lib == "torch"
    la, lb = _lib_array(a, torch_mode), _lib_array(b, torch_mode)

    def run(x, y):
        f = op.function()
        if op.arity == 1:
            return f(x)
        if form == "forward":
            return f(x, y)
        if form in ("reflected", "local_left"):
            return f(y, x)
        alias = x
        x = op.inplace_function()(x, y)  # exactly what ``x OP= y`` runs
        same = x.get() if isinstance(x, mw.RemoteTensor) else x
        before = alias.get() if isinstance(alias, mw.RemoteTensor) else alias
        if x is not alias:  # rebound (no in-place form): the old name keeps its value
            return np.asarray(same)
        if not np.array_equal(np.asarray(same), np.asarray(before), equal_nan=True):
            raise AssertionError("the name and its alias differ after an in-place op")
        return before

    ra = mw.send(la, node=node)
    rb = mw.send(lb, node=node) if isinstance(b, np.ndarray) and form != "local_left" else lb
    if form == "inplace":
        la = la.clone() if torch_mode else la.copy()
    return _outcome(lambda: run(la, lb)), _outcome(lambda: run(ra, rb))


# augmented assignments as a user writes them (x: the float tensor, y: the int one)
def _ipow(x, y):
    x **= 2
    return x


def _iadd_self(x, y):
    x += x
    return x


def _isub(x, y):
    x -= 1
    return x


def _imul(x, y):
    x *= 3
    return x


def _itruediv(x, y):
    x /= 2
    return x


def _ifloordiv(x, y):
    x //= 2
    return x


def _imod(x, y):
    x %= 2
    return x


def _ilshift(x, y):
    y <<= 2
    return y


def _irshift(x, y):
    y >>= 1
    return y


def _iand(x, y):
    y &= 6
    return y


def _ior(x, y):
    y |= 1
    return y


def _ixor(x, y):
    y ^= 3
    return y


def operator_spellings():
    """The operators as a user writes them, remote vs local: {spelling: same?}."""
    torch_mode = mw.master.get_master().lib == "torch"
    base = np.arange(1, 7, dtype=np.float32).reshape(2, 3) / 4
    ints = np.arange(-3, 3, dtype=np.int64).reshape(2, 3)
    cases = {
        "a ** 2": lambda a, i: a ** 2, "2 ** a": lambda a, i: 2 ** a,
        "a ** a": lambda a, i: a ** a, "a ** 0.5": lambda a, i: a ** 0.5,
        "1 - a": lambda a, i: 1 - a, "3 / a": lambda a, i: 3 / a, "2 * a": lambda a, i: 2 * a,
        "1 + a": lambda a, i: 1 + a, "7 // i": lambda a, i: 7 // (i + 4),
        "7 % i": lambda a, i: 7 % (i + 4), "1 << i": lambda a, i: 1 << (i + 3),
        "64 >> i": lambda a, i: 64 >> (i + 3), "5 & i": lambda a, i: 5 & i,
        "5 | i": lambda a, i: 5 | i, "5 ^ i": lambda a, i: 5 ^ i,
        "i << 1": lambda a, i: i << 1, "i >> 1": lambda a, i: i >> 1,
        "-a": lambda a, i: -a, "+a": lambda a, i: +a, "abs(i)": lambda a, i: abs(i),
        "~i": lambda a, i: ~i, "a @ a.T": lambda a, i: a @ a.T,
        "1 < a": lambda a, i: 1 < a, "a >= 0.5": lambda a, i: a >= 0.5,
    }
    inplace = {"a **= 2": _ipow, "a += a": _iadd_self, "a -= 1": _isub, "a *= 3": _imul,
               "a /= 2": _itruediv, "a //= 2": _ifloordiv, "a %= 2": _imod,
               "i <<= 2": _ilshift, "i >>= 1": _irshift, "i &= 6": _iand, "i |= 1": _ior,
               "i ^= 3": _ixor}
    out = {}
    la, li = _lib_array(base, torch_mode), _lib_array(ints, torch_mode)
    ra, ri = mw.send(la, node=0), mw.send(li, node=0)
    for k, f in cases.items():
        want, got = _outcome(f, la, li), _outcome(f, ra, ri)
        out[k] = want[0] == got[0] == "ok" and want[1].dtype == got[1].dtype and \
            np.array_equal(want[1], got[1])
    for k, f in inplace.items():
        res = []
        for x, y in ((la, li), (mw.send(la, node=0), mw.send(li, node=0))):
            x = x.clone() if hasattr(x, "clone") else x.copy()
            y = y.clone() if hasattr(y, "clone") else y.copy()
            res.append(_outcome(f, x, y))
        out[k] = res[0][0] == res[1][0] == "ok" and res[0][1].dtype == res[1][1].dtype and \
            np.array_equal(res[0][1], res[1][1])
    return out


def list_function_case(name, arrays, kwargs, node=0):
    """NumPy function ``name`` (concatenate, stack, vstack...) on a list of remote tensors
    and on the same local ones: (local outcome, remote outcome)."""
    torch_mode = mw.master.get_master().lib == "torch"
    f = getattr(np, name)
    local = [_lib_array(a, torch_mode) for a in arrays]
    remote = [mw.send(x, node=node) for x in local]
    if name == "block":  # a nested list: the first half above the second
        h = len(local) // 2 or 1
        local, remote = [local[:h], local[h:]], [remote[:h], remote[h:]]
    return _outcome(lambda: f(local, **kwargs)), _outcome(lambda: f(remote, **kwargs))


def call_opinfo(which):
    """tests/master_worker/mw_opinfo.py's sweep on this master: the quick slice, or 'all'."""
    from tests.master_worker import mw_opinfo
    s = mw_opinfo.sweep(None if which == "all" else mw_opinfo.QUICK)
    return {k: s[k] for k in ("ops", "passed", "counted", "fraction", "fail_classes", "results")}


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

