"""Remote tensors: handles the master holds to arrays that live on a worker node.

A remote tensor joins torch's and NumPy's dispatch protocols: any torch function,
Tensor method or ``torch.nn.functional`` call (torch mode), any NumPy ufunc or array
function (NumPy mode) given remote tensors runs on their node (see remote_call.py for what
travels and what comes back). An operation queues a command and returns a new handle at
once; the data stays on the node. Copies back (``get``, ``numpy``, ``item``...), values
(a shape the master does not know, a Python number), ``synchronize`` and ``Event.wait``
are the sync points, where failures the node hit are raised.
"""
import numbers

import numpy as np

import collectives.master_worker.protocol as P
from ..core.convert import buffer
import collectives.master_worker.remote_call as dispatch
from .codec import Ref
from .remote_call import method_entry, operator_entry
from .master import _ctx, current_node, get_master
from .operators import BY_NAME, OPERATORS
from .ops import check_shape, dtype_name

# ---- which node ------------------------------------------------------------------------------
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
        s = self._info()[0]
        return s if self._m.torch is None else self._m.torch.Size(s)

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
        expect = (meta[0], meta[1]) if meta is not None and not bulk else None
        e = m.call(nd, P.C_GET, (ref.hid, bulk, expect), handler, "get",
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

    # -- the dispatch protocols: torch / NumPy functions given remote tensors run remotely
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return dispatch.torch_function(func, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return dispatch.array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return dispatch.array_function(func, args, kwargs)

    def __getattr__(self, attr):
        """Tensor methods and properties this class does not define run on the node."""
        if attr.startswith("__") or attr in RemoteTensor.__slots__:
            raise AttributeError(attr)
        e = method_entry(self._m, attr)
        if e.prop:
            return dispatch.call_entry(self._m, e, (self,), None)
        setattr(RemoteTensor, attr, _method(attr))  # found once; later calls skip this
        return getattr(self, attr)

    def __reduce_ex__(self, protocol):
        raise TypeError("a RemoteTensor is a handle to data on a worker node and cannot be "
                        "pickled: copy it back first (.get())")

    # -- operators (queued): what Python does with the node's tensors or arrays
    # (operators.py lists them; _operators() below gives this class their methods)
    def _op(self, key, *args):
        m = self._m
        e = m.operators.get(key) or operator_entry(m, key)
        if e is False:  # the node's arrays lack it: Python raises its TypeError
            return NotImplemented
        return dispatch.call_entry(m, e, (self,) + args, None)

    def _rop(self, key, other):
        m = self._m
        e = m.operators.get(key) or operator_entry(m, key)
        if e is False:
            return NotImplemented
        return dispatch.call_entry(m, e, (other, self), None)

    def _iop(self, key, o):
        m = self._m
        e = m.operators.get("i" + key)
        if e is None:
            e = operator_entry(m, "i" + key)
        if e is False:  # the arrays have no in-place form: a new tensor, as Python does
            return self._op(key, o)
        if type(o) in _NUMBERS and m.torch is None:  # the hot path (no grad mode to send)
            m.command(self._nd, P.C_CALL, (e.wire, -1, (self._ref(), o)))
            return self
        return dispatch.call_entry(m, e, (self, o), None)

    __hash__ = object.__hash__

    def __getitem__(self, key):
        return dispatch.method(self, "__getitem__", (key,), None)

    def __setitem__(self, key, value):
        dispatch.method(self, "__setitem__", (key, value), None)

    def add_(self, o):  # the hot in-place path (bench_master_worker's queued ops)
        m = self._m
        e = m.methods.get("add_") or method_entry(m, "add_")
        if type(o) in _NUMBERS and m.torch is None:
            m.command(self._nd, P.C_CALL, (e.wire, -1, (self._ref(), o)))
            return self
        return dispatch.call_entry(m, e, (self, o), None)

    @property
    def T(self):  # noqa: N802
        m = self._m
        if m.torch is None:
            return dispatch.method(self, "t", (), None)
        return dispatch.call_entry(m, method_entry(m, "T"), (self,), None)

    def cuda(self, device=None):
        """A copy on CUDA device ``device`` (default 0) of this tensor's node."""
        d = _device(0 if device is None else device, self._nd)
        meta = None if self._meta is None else (self._meta[0], self._meta[1], d)
        r = dispatch.method(self, "cuda", (d,), None)
        if meta is not None and isinstance(r, RemoteTensor) and r._meta is None:
            r._meta = meta
        return r

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


_NUMBERS = frozenset((int, float, bool))


def _method(attr):
    def method(self, *args, **kwargs):
        return dispatch.method(self, attr, args, kwargs)
    method.__name__ = method.__qualname__ = attr
    method.__doc__ = f"``Tensor.{attr}`` run on this tensor's node."
    return method


def _operators(cls):
    """Give ``cls`` every operator's forward, reflected and in-place methods (operators.py),
    each queuing ``_op``/``_rop``/``_iop`` with the operator's name."""
    def forward(key):
        if BY_NAME[key].arity == 1:
            return lambda self: self._op(key)
        return lambda self, o: self._op(key, o)

    def reflected(key):
        return lambda self, o: self._rop(key, o)

    def inplace(key):
        return lambda self, o: self._iop(key, o)

    for op in OPERATORS:
        for dunder, make in ((op.forward, forward), (op.reflected, reflected),
                             (op.inplace, inplace)):
            if dunder is None:
                continue
            f = make(op.name)
            f.__name__ = dunder
            f.__qualname__ = f"{cls.__name__}.{dunder}"
            f.__doc__ = f"``{op.symbol}`` on this tensor's node."
            setattr(cls, dunder, f)


_operators(RemoteTensor)
dispatch.Handle = RemoteTensor


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
def _alloc(kind, shape, dtype, value, node, device, requires_grad=False):
    m, nd = _node_of(node)
    m.usable(nd)
    shape = check_shape(shape)
    dt = dtype_name(dtype)
    dev = _device(device, nd)
    if value is not None and not isinstance(value, (bool, numbers.Number)):
        raise TypeError(f"fill_value must be a number, got {type(value).__name__}")
    if requires_grad and m.torch is None:
        raise ValueError("requires_grad=True needs torch on the workers (library='torch')")
    out = m.new_hid(nd)
    m.command(nd, P.C_ALLOC, (out, kind, shape, dt, value, dev))
    t = RemoteTensor(m, nd, out, (shape, dt, dev))
    return t.requires_grad_() if requires_grad else t


def empty(*shape, dtype=None, node=None, device=None, requires_grad=False):
    """An uninitialised tensor of ``shape`` on ``node`` (default: the current node)."""
    return _alloc("empty", shape, dtype, None, node, device, requires_grad)


def zeros(*shape, dtype=None, node=None, device=None, requires_grad=False):
    return _alloc("zeros", shape, dtype, None, node, device, requires_grad)


def ones(*shape, dtype=None, node=None, device=None, requires_grad=False):
    return _alloc("ones", shape, dtype, None, node, device, requires_grad)


def full(shape, fill_value, dtype=None, node=None, device=None, requires_grad=False):
    if isinstance(shape, int):
        shape = (shape,)
    return _alloc("full", (tuple(shape),), dtype, fill_value, node, device, requires_grad)


def rand(*shape, dtype=None, node=None, device=None, requires_grad=False):
    """Uniform [0, 1) floats, from the node's generator (``manual_seed``)."""
    return _alloc("rand", shape, dtype, None, node, device, requires_grad)


def randn(*shape, dtype=None, node=None, device=None, requires_grad=False):
    return _alloc("randn", shape, dtype, None, node, device, requires_grad)


def send(data, node=None, device=None, dtype=None, requires_grad=None):
    """Copy a local array, torch tensor or nested list to ``node``: a remote tensor.

    The seed's ``tensor.dist_send()``; returns once the data is handed to the transport.
    ``requires_grad`` (default: the torch tensor's own flag) makes it a leaf of the
    node's autograd graph.
    """
    m, nd = _node_of(node)
    m.usable(nd)
    if requires_grad is None:
        requires_grad = bool(getattr(data, "requires_grad", False))
    if requires_grad and m.torch is None:
        raise ValueError("requires_grad=True needs torch on the workers (library='torch')")
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
    t = RemoteTensor(m, nd, out, (shape, dt, dev))
    return t.requires_grad_() if requires_grad else t


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
