"""Remote tensors: handles the master holds to arrays that live on a worker node.

An operation on a remote tensor queues a command on its node and returns a new handle
at once; the data stays on the node. Copies back (``get``, ``numpy``, ``item``...),
shape queries not known on the master, ``synchronize`` and ``Event.wait`` are the sync
points, where failures the node hit are raised.
"""
import numbers
import threading

import numpy as np

import collectives.master_worker.protocol as P
from .._frontend import buffer
from .codec import Ref
from .master import get_master
from .ops import OPCODE, check_shape, dtype_name

_ctx = threading.local()


# ---- which node ------------------------------------------------------------------------------
def current_node():
    """The node new tensors go to (``with node(k):`` sets it; default 0)."""
    return getattr(_ctx, "node", 0)


class node:  # noqa: N801  (torch.cuda.device's spelling, as in the seed)
    """``with node(k):`` tensors made inside are allocated on worker node ``k``."""

    def __init__(self, k):
        get_master().node(k)  # validates
        self.k = int(k)

    def __enter__(self):
        self.prev = current_node()
        _ctx.node = self.k
        return self

    def __exit__(self, *exc):
        _ctx.node = self.prev


def set_node(k):
    """Make ``k`` the current node (until changed)."""
    get_master().node(k)
    _ctx.node = int(k)


def num_nodes():
    """The number of worker nodes (world size - 1)."""
    return len(get_master().nodes)


def _node_of(node_arg):
    m = get_master()
    return m, m.node(current_node() if node_arg is None else node_arg)


def _device(device, nd):
    if device is None or device == "cpu" or device == -1:
        return -1
    if isinstance(device, str) and device.startswith("cuda"):
        device = int(device.split(":")[1]) if ":" in device else 0
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device must be -1/'cpu', a CUDA index or 'cuda:k', got {device!r}")
    if device >= nd.ncuda:
        raise ValueError(f"device={device}: node {nd.index} has {nd.ncuda} CUDA device(s)")
    return device


# ---- the handle --------------------------------------------------------------------------------
class RemoteTensor:
    """A tensor on worker node ``get_node()``, driven from the master."""

    __slots__ = ("_m", "_nd", "_hid", "_meta", "__weakref__")
    __array_ufunc__ = None  # ndarray (op) remote -> our reflected op, which refuses local data

    def __init__(self, master, nd, hid, meta=None):
        self._m, self._nd, self._hid, self._meta = master, nd, hid, meta

    def __del__(self):
        try:
            if self._hid and not self._m.closed:
                self._nd.frees.append(self._hid)
        except AttributeError:  # half-built
            pass

    # -- identity
    def get_node(self):
        """The worker node holding this tensor."""
        return self._nd.index

    def get_device(self):
        """The CUDA device on its node, or -1 for CPU."""
        return self._info()[2]

    def _ref(self):
        if not self._hid:
            raise ValueError("this remote tensor was freed")
        if self._hid in self._nd.failed:
            raise RuntimeError(f"this remote tensor is failed: {self._nd.failed[self._hid]}")
        self._m.usable(self._nd)
        return Ref(self._hid)

    def free(self):
        """Release the node's memory now (the handle is unusable afterwards)."""
        if self._hid:
            self._nd.frees.append(self._hid)
            self._hid = 0

    # -- metadata (a sync point when not known on the master)
    def _info(self):
        if self._meta is None:
            self._ref()
            m = self._m

            def handler(ok, payload):
                if not ok:
                    raise RuntimeError(f"node {self._nd.index}: {payload}")
                if payload[0] != "array":
                    raise TypeError(f"node {self._nd.index} holds a {type(payload[1]).__name__} "
                                    "here, not a tensor")
                return (tuple(payload[1]), payload[2], payload[3])
            e = m.call(self._nd, P.C_META, (self._hid,), handler, "meta")
            try:
                self._meta = m.resolve(self._nd, e)
            finally:
                m.check(self._nd)
        return self._meta

    @property
    def shape(self):
        return self._info()[0]

    def size(self, dim=None):
        s = self.shape
        return s if dim is None else s[dim]

    @property
    def dtype(self):
        name = self._info()[1]
        if self._m.lib == "torch":
            import torch
            return getattr(torch, name)
        return name if name == "bfloat16" else np.dtype(name)

    @property
    def ndim(self):
        return len(self.shape)

    def dim(self):
        return self.ndim

    def numel(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self):
        s = self.shape
        if not s:
            raise TypeError("len() of a 0-d tensor")
        return s[0]

    def __iter__(self):  # without it Python would index past the end forever (errors are async)
        for i in range(len(self)):
            yield self[i]

    def __repr__(self):
        if not self._hid:
            return f"RemoteTensor(node={self._nd.index}, freed)"
        meta = "" if self._meta is None else f", shape={self._meta[0]}, dtype={self._meta[1]}"
        return f"RemoteTensor(node={self._nd.index}, id={self._hid}{meta})"

    # -- copies back (sync points)
    def get(self):
        """A local copy (a torch tensor when workers hold torch tensors, else NumPy)."""
        a = self.numpy()
        if self._m.lib == "torch" and isinstance(a, np.ndarray):
            import torch
            return torch.from_numpy(a)
        return a

    to_local = get

    def numpy(self):
        """A local NumPy copy of the data (waits for the commands before it)."""
        ref = self._ref()
        m, nd = self._m, self._nd
        m.pair(nd)
        meta = self._meta
        out = bulk = None
        if meta is not None:  # the receive is posted before the data can arrive
            out = _host_empty(meta[0], meta[1])
            bulk = _nbytes(out) >= P.BULK_MIN

        def handler(ok, payload):
            nonlocal out
            if not ok:
                if meta is None:  # the worker sent an empty data message: take it
                    m._wait(nd, m.backend.irecv(buffer(_EMPTY), nd.rank, P.T_DATA), "get")
                raise RuntimeError(f"node {nd.index}: get failed: {payload}")
            if payload[0] != "array":
                if meta is None:
                    m._wait(nd, m.backend.irecv(buffer(_EMPTY), nd.rank, P.T_DATA), "get")
                return payload[1]
            if meta is None:
                self._meta = (tuple(payload[1]), payload[2], payload[3])
                out = _host_empty(self._meta[0], self._meta[1])
                if not payload[4]:
                    m._wait(nd, m.backend.irecv(buffer(out), nd.rank, P.T_DATA), "get")
            if payload[4]:
                m.bulk(nd, out, nd.rank)
            return out
        e = m.call(nd, P.C_GET, (ref.hid, bulk), handler, "get",
                   data=out if meta is not None and not bulk else None)
        try:
            return m.resolve(nd, e)
        finally:
            m.check(nd)

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def item(self):
        return self.numpy().reshape(()).item() if self.numel() == 1 else _one_elem_error()

    def tolist(self):
        return self.numpy().tolist()

    def __bool__(self):
        return bool(self.item())

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    # -- operations (queued)
    def _arg(self, v, name="operand"):
        if isinstance(v, RemoteTensor):
            if v._nd is not self._nd:
                raise ValueError(f"{name} is on node {v._nd.index}, this tensor on node "
                                 f"{self._nd.index}: move one explicitly with .to_node(k)")
            return v._ref()
        if isinstance(v, (bool, numbers.Number, np.generic)) and not isinstance(v, np.ndarray):
            return v.item() if isinstance(v, np.generic) else v
        if v is None:
            return None
        raise TypeError(f"{name} is a local {type(v).__name__}: send it to node "
                        f"{self._nd.index} first (collectives.send(x, node=...)); only Python "
                        "numbers mix with remote tensors")

    def _key(self, k):
        t = type(k)
        if t is tuple:
            return tuple(self._key(x) for x in k)
        if t is list:
            return [self._key(x) for x in k]
        if t is slice:
            return slice(self._key(k.start), self._key(k.stop), self._key(k.step))
        if isinstance(k, RemoteTensor):
            return self._arg(k, "index")
        if isinstance(k, np.ndarray) and (k.dtype == bool or k.dtype.kind in "iu"):
            return k
        if k is None or k is Ellipsis or isinstance(k, (bool, int, np.integer)):
            return k.item() if isinstance(k, np.generic) else k
        raise TypeError(f"unsupported index {k!r}")

    def _op(self, name, *args, meta=None):
        m, nd = self._m, self._nd
        enc = (self._ref(),) + args
        out = m.new_hid(nd)
        m.command(nd, P.C_OP, (OPCODE[name], out, enc))
        return RemoteTensor(m, nd, out, meta)

    def _inplace(self, name, *args):
        self._m.command(self._nd, P.C_OP, (OPCODE[name], -1, (self._ref(),) + args))
        return self

    def _bin(self, name, other, reflected=False):
        o = self._arg(other)
        if reflected:
            m, nd = self._m, self._nd
            out = m.new_hid(nd)
            m.command(nd, P.C_OP, (OPCODE[name], out, (o, self._ref())))
            return RemoteTensor(m, nd, out)
        return self._op(name, o)

    def __add__(self, o): return self._bin("add", o)  # noqa: E704
    def __radd__(self, o): return self._bin("add", o, True)  # noqa: E704
    def __sub__(self, o): return self._bin("sub", o)  # noqa: E704
    def __rsub__(self, o): return self._bin("sub", o, True)  # noqa: E704
    def __mul__(self, o): return self._bin("mul", o)  # noqa: E704
    def __rmul__(self, o): return self._bin("mul", o, True)  # noqa: E704
    def __truediv__(self, o): return self._bin("truediv", o)  # noqa: E704
    def __rtruediv__(self, o): return self._bin("truediv", o, True)  # noqa: E704
    def __floordiv__(self, o): return self._bin("floordiv", o)  # noqa: E704
    def __rfloordiv__(self, o): return self._bin("floordiv", o, True)  # noqa: E704
    def __mod__(self, o): return self._bin("mod", o)  # noqa: E704
    def __rmod__(self, o): return self._bin("mod", o, True)  # noqa: E704
    def __pow__(self, o): return self._bin("pow", o)  # noqa: E704
    def __rpow__(self, o): return self._bin("pow", o, True)  # noqa: E704
    def __matmul__(self, o): return self._bin("matmul", o)  # noqa: E704
    def __rmatmul__(self, o): return self._bin("matmul", o, True)  # noqa: E704
    def __and__(self, o): return self._bin("and", o)  # noqa: E704
    def __rand__(self, o): return self._bin("and", o, True)  # noqa: E704
    def __or__(self, o): return self._bin("or", o)  # noqa: E704
    def __ror__(self, o): return self._bin("or", o, True)  # noqa: E704
    def __xor__(self, o): return self._bin("xor", o)  # noqa: E704
    def __rxor__(self, o): return self._bin("xor", o, True)  # noqa: E704
    def __eq__(self, o): return self._bin("eq", o)  # noqa: E704
    def __ne__(self, o): return self._bin("ne", o)  # noqa: E704
    def __lt__(self, o): return self._bin("lt", o)  # noqa: E704
    def __le__(self, o): return self._bin("le", o)  # noqa: E704
    def __gt__(self, o): return self._bin("gt", o)  # noqa: E704
    def __ge__(self, o): return self._bin("ge", o)  # noqa: E704
    __hash__ = object.__hash__

    def __neg__(self): return self._op("neg")  # noqa: E704
    def __pos__(self): return self._op("pos")  # noqa: E704
    def __abs__(self): return self._op("abs")  # noqa: E704
    def __invert__(self): return self._op("invert")  # noqa: E704

    def __iadd__(self, o): return self.add_(o)  # noqa: E704
    def __isub__(self, o): return self.sub_(o)  # noqa: E704
    def __imul__(self, o): return self.mul_(o)  # noqa: E704
    def __itruediv__(self, o): return self.div_(o)  # noqa: E704

    def add(self, o): return self._bin("add", o)  # noqa: E704
    def sub(self, o): return self._bin("sub", o)  # noqa: E704
    def mul(self, o): return self._bin("mul", o)  # noqa: E704
    def div(self, o): return self._bin("truediv", o)  # noqa: E704
    def matmul(self, o): return self._bin("matmul", o)  # noqa: E704
    def maximum(self, o): return self._bin("maximum", o)  # noqa: E704
    def minimum(self, o): return self._bin("minimum", o)  # noqa: E704

    def exp(self): return self._op("exp")  # noqa: E704
    def log(self): return self._op("log")  # noqa: E704
    def sqrt(self): return self._op("sqrt")  # noqa: E704
    def sin(self): return self._op("sin")  # noqa: E704
    def cos(self): return self._op("cos")  # noqa: E704
    def tanh(self): return self._op("tanh")  # noqa: E704
    def sigmoid(self): return self._op("sigmoid")  # noqa: E704
    def relu(self): return self._op("relu")  # noqa: E704
    def floor(self): return self._op("floor")  # noqa: E704
    def ceil(self): return self._op("ceil")  # noqa: E704
    def sign(self): return self._op("sign")  # noqa: E704
    def square(self): return self._op("square")  # noqa: E704
    def abs(self): return self._op("abs")  # noqa: E704
    def neg(self): return self._op("neg")  # noqa: E704

    def _reduce(self, name, dim, keepdim, *extra):
        if dim is not None and not isinstance(dim, int):
            dim = tuple(int(d) for d in dim)
        return self._op(name, dim, bool(keepdim), *extra)

    def sum(self, dim=None, keepdim=False): return self._reduce("sum", dim, keepdim)  # noqa: E704
    def mean(self, dim=None, keepdim=False): return self._reduce("mean", dim, keepdim)  # noqa: E704
    def prod(self, dim=None, keepdim=False): return self._reduce("prod", dim, keepdim)  # noqa: E704
    def max(self, dim=None, keepdim=False): return self._reduce("max", dim, keepdim)  # noqa: E704
    def min(self, dim=None, keepdim=False): return self._reduce("min", dim, keepdim)  # noqa: E704
    def argmax(self, dim=None, keepdim=False): return self._reduce("argmax", dim, keepdim)  # noqa: E704
    def argmin(self, dim=None, keepdim=False): return self._reduce("argmin", dim, keepdim)  # noqa: E704
    def all(self, dim=None, keepdim=False): return self._reduce("all", dim, keepdim)  # noqa: E704
    def any(self, dim=None, keepdim=False): return self._reduce("any", dim, keepdim)  # noqa: E704

    def std(self, dim=None, keepdim=False, correction=1):
        return self._reduce("std", dim, keepdim, int(correction))

    def var(self, dim=None, keepdim=False, correction=1):
        return self._reduce("var", dim, keepdim, int(correction))

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return self._op("reshape", tuple(int(d) for d in shape))

    view = reshape

    def transpose(self, d0, d1): return self._op("transpose", int(d0), int(d1))  # noqa: E704
    def t(self): return self._op("t")  # noqa: E704

    @property
    def T(self):  # noqa: N802
        return self.t()

    def permute(self, *dims):
        dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
        return self._op("permute", tuple(int(d) for d in dims))

    def flatten(self): return self._op("flatten")  # noqa: E704
    def squeeze(self, dim=None): return self._op("squeeze", dim)  # noqa: E704
    def unsqueeze(self, dim): return self._op("unsqueeze", int(dim))  # noqa: E704

    def clone(self):
        return self._op("clone", meta=self._meta)

    def contiguous(self):
        return self._op("contiguous", meta=self._meta)

    def to(self, dtype):
        """A copy converted to ``dtype`` (on the same node)."""
        d = dtype_name(dtype)
        meta = None if self._meta is None else (self._meta[0], d, self._meta[2])
        return self._op("astype", d, meta=meta)

    astype = to

    def float(self): return self.to("float32")  # noqa: E704
    def double(self): return self.to("float64")  # noqa: E704
    def long(self): return self.to("int64")  # noqa: E704
    def int(self): return self.to("int32")  # noqa: E704

    def clamp(self, min=None, max=None): return self._op("clip", min, max)  # noqa: A002,E704
    clip = clamp

    def where(self, a, b):
        """``where(self, a, b)`` element-wise (self is the condition)."""
        return self._op("where", self._arg(a), self._arg(b))

    def __getitem__(self, key):
        return self._op("getitem", self._key(key))

    def __setitem__(self, key, value):
        self._inplace("setitem", self._key(key), self._arg(value, "value"))

    def cuda(self, device=None):
        """A copy on CUDA device ``device`` (default 0) of this tensor's node."""
        d = _device(0 if device is None else device, self._nd)
        meta = None if self._meta is None else (self._meta[0], self._meta[1], d)
        return self._op("cuda", d, meta=meta)

    def cpu(self):
        meta = None if self._meta is None else (self._meta[0], self._meta[1], -1)
        return self._op("cpu", meta=meta)

    # -- in place (return self, queued)
    def fill_(self, v): return self._inplace("fill_", self._arg(v, "value"))  # noqa: E704
    def zero_(self): return self._inplace("zero_")  # noqa: E704
    def add_(self, o): return self._inplace("add_", self._arg(o))  # noqa: E704
    def sub_(self, o): return self._inplace("sub_", self._arg(o))  # noqa: E704
    def mul_(self, o): return self._inplace("mul_", self._arg(o))  # noqa: E704
    def div_(self, o): return self._inplace("div_", self._arg(o))  # noqa: E704
    def pow_(self, o): return self._inplace("pow_", self._arg(o))  # noqa: E704
    def copy_(self, src): return self._inplace("copy_", self._arg(src, "src"))  # noqa: E704

    def clamp_(self, min=None, max=None):  # noqa: A002
        return self._inplace("clamp_", self._arg(min), self._arg(max))

    # -- moving
    def to_node(self, k):
        """This tensor on node ``k`` (itself if already there); moves worker to worker."""
        m = self._m
        dst = m.node(k)
        if dst is self._nd:
            return self
        ref = self._ref()
        m.usable(dst)
        out = m.new_hid(dst)
        m.command(self._nd, P.C_SENDTO, (ref.hid, dst.rank))
        m.command(dst, P.C_RECVFROM, (out, self._nd.rank))
        meta = None if self._meta is None else (self._meta[0], self._meta[1], -1)
        return RemoteTensor(m, dst, out, meta)


_EMPTY = np.empty(0, np.uint8)


def _nbytes(a):
    return a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()


def _host_empty(shape, dtype):
    if dtype == "bfloat16":
        import torch
        return torch.empty(shape, dtype=torch.bfloat16)
    return np.empty(shape, dtype)


def _one_elem_error():
    raise ValueError("only one-element tensors can be converted to Python scalars")


# ---- making remote tensors ---------------------------------------------------------------------
def _alloc(kind, shape, dtype, value, node, device):
    m, nd = _node_of(node)
    m.usable(nd)
    shape = check_shape(shape)
    dt = dtype_name(dtype)
    dev = _device(device, nd)
    if value is not None and not isinstance(value, (bool, numbers.Number)):
        raise TypeError(f"fill_value must be a number, got {type(value).__name__}")
    out = m.new_hid(nd)
    m.command(nd, P.C_ALLOC, (out, kind, shape, dt, value, dev))
    return RemoteTensor(m, nd, out, (shape, dt, dev))


def empty(*shape, dtype=None, node=None, device=None):
    """An uninitialised tensor of ``shape`` on ``node`` (default: the current node)."""
    return _alloc("empty", shape, dtype, None, node, device)


def zeros(*shape, dtype=None, node=None, device=None):
    return _alloc("zeros", shape, dtype, None, node, device)


def ones(*shape, dtype=None, node=None, device=None):
    return _alloc("ones", shape, dtype, None, node, device)


def full(shape, fill_value, dtype=None, node=None, device=None):
    if isinstance(shape, int):
        shape = (shape,)
    return _alloc("full", (tuple(shape),), dtype, fill_value, node, device)


def rand(*shape, dtype=None, node=None, device=None):
    """Uniform [0, 1) floats, from the node's generator (``manual_seed``)."""
    return _alloc("rand", shape, dtype, None, node, device)


def randn(*shape, dtype=None, node=None, device=None):
    return _alloc("randn", shape, dtype, None, node, device)


def send(data, node=None, device=None, dtype=None):
    """Copy a local array, torch tensor or nested list to ``node``: a remote tensor.

    The seed's ``tensor.dist_send()``; returns once the data is handed to the transport.
    """
    m, nd = _node_of(node)
    m.usable(nd)
    if hasattr(data, "detach") and hasattr(data, "cpu"):  # a torch tensor
        src = data.detach().cpu().contiguous()
        dt = str(src.dtype)[6:]
        if dt != "bfloat16":
            src = src.numpy()
        shape = tuple(src.shape)
    else:
        src = np.asarray(data)
        if dtype is None and src.dtype == np.float64 and not isinstance(data, np.ndarray):
            src = src.astype(np.float32)  # torch's default for Python floats
        dt = dtype_name(src.dtype)
        src = np.asarray(src, order="C")
        if not src.flags.writeable:  # the transport takes writable buffers only
            src = src.copy()
        shape = tuple(src.shape)
    if dtype is not None:
        want = dtype_name(dtype)
        if want != dt:
            if isinstance(src, np.ndarray):
                src = src.astype(want)
            else:
                import torch
                src = src.to(getattr(torch, want))
            dt = want
    dev = _device(device, nd)
    bulk = _nbytes(src) >= P.BULK_MIN
    if bulk:
        m.pair(nd)
    out = m.new_hid(nd)
    m.command(nd, P.C_PUT, (out, shape, dt, dev, bulk))
    if bulk:
        m.bulk(nd, src, 0)
    else:
        m.send_data(nd, src)
    return RemoteTensor(m, nd, out, (shape, dt, dev))


tensor = send


def _typed(dtype):
    def make(*args, node=None, device=None):
        if len(args) == 1 and not isinstance(args[0], (int, np.integer)):
            return send(args[0], node=node, device=device, dtype=dtype)  # data, as torch does
        return _alloc("empty", args, dtype, None, node, device)
    make.__name__ = make.__qualname__ = {
        "float32": "FloatTensor", "float64": "DoubleTensor", "float16": "HalfTensor",
        "bfloat16": "BFloat16Tensor", "int64": "LongTensor", "int32": "IntTensor",
        "int16": "ShortTensor", "int8": "CharTensor", "uint8": "ByteTensor",
        "bool": "BoolTensor"}[dtype]
    make.__doc__ = (f"``{make.__name__}(*shape, node=None, device=None)``: an uninitialised "
                    f"{dtype} remote tensor on the current node (or from data, as torch's).")
    return make


FloatTensor = _typed("float32")
DoubleTensor = _typed("float64")
HalfTensor = _typed("float16")
BFloat16Tensor = _typed("bfloat16")
LongTensor = _typed("int64")
IntTensor = _typed("int32")
ShortTensor = _typed("int16")
CharTensor = _typed("int8")
ByteTensor = _typed("uint8")
BoolTensor = _typed("bool")
