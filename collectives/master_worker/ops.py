"""The two array libraries a worker may hold data in (NumPy, torch): allocation,
metadata, host copies, named constants, and the functions a call may name.

A call names its function (``torch.matmul``, ``torch.Tensor.add_``, ``numpy.exp``...); the
worker finds it in its library's allow-list (:mod:`.allow`). In NumPy mode a remote
tensor's methods keep torch's spelling (``t.sum(dim, keepdim)``, ``t.add_(1)``...): they are
the ``Tensor.*`` functions below, written once on NumPy arrays.
"""
import operator

import numpy as np

from .allow import Entry, numpy_table, torch_table

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "complex64", "complex128")
_PY_DEFAULT = {float: "float32", int: "int64", bool: "bool", complex: "complex64"}


def dtype_name(dtype, default="float32"):
    """The canonical name ('float32', ...) of a dtype given as a name, NumPy dtype or type,
    torch dtype or Python type; ValueError/TypeError naming the argument otherwise."""
    if dtype is None:
        return default
    if dtype in _PY_DEFAULT:
        return _PY_DEFAULT[dtype]
    s = str(dtype)
    if s.startswith("torch."):
        s = s[6:]
        s = {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
             "int": "int32", "short": "int16", "cfloat": "complex64",
             "cdouble": "complex128"}.get(s, s)
    elif s != "bfloat16":
        try:
            s = np.dtype(dtype).name
        except TypeError:
            raise TypeError(f"dtype must be a dtype name, NumPy dtype or torch dtype, "
                            f"got {dtype!r}") from None
    if s not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return s


def check_shape(shape, name="shape"):
    """A shape given as ints or one sequence of ints -> a tuple of non-negative ints."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{name} must be ints, got {d!r}")
        if d < 0:
            raise ValueError(f"{name} must be non-negative, got {tuple(shape)}")
        out.append(int(d))
    return tuple(out)



# ---- NumPy mode: a remote tensor's methods, in torch's spelling, on NumPy arrays ------------
def _reduce(f):
    def method(a, dim=None, keepdim=False):
        if isinstance(dim, list):
            dim = tuple(dim)
        return np.asarray(f(a, axis=dim, keepdims=keepdim))
    return method


def _arg_reduce(f):
    def method(a, dim=None, keepdim=False):
        return np.asarray(f(a, axis=dim, keepdims=keepdim))
    return method


def _moments(f):
    def method(a, dim=None, keepdim=False, correction=1):
        if isinstance(dim, list):
            dim = tuple(dim)
        return np.asarray(f(a, axis=dim, keepdims=keepdim, ddof=correction))
    return method


def _shape_args(shape):
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


def _t(a):
    if a.ndim > 2:
        raise ValueError(f"t() expects a tensor with <= 2 dimensions, got {a.ndim}")
    return a.T


def _to(a, dtype):
    name = dtype_name(dtype)
    if name == "bfloat16":
        raise TypeError("bfloat16 needs torch on the workers")
    return a.astype(name)


def _iop(f):
    def method(a, o):
        f(a, o)
        return a
    return method


def _fill(a, v):
    a[...] = v
    return a


def _copy(a, src):
    np.copyto(a, src, casting="unsafe")
    return a


def _clamp_(a, min=None, max=None):  # noqa: A002
    np.clip(a, min, max, out=a)
    return a


def _setitem(a, k, v):
    a[k] = v


def _no_cuda(a, *args):
    raise RuntimeError("this worker holds NumPy arrays: it has no CUDA device "
                       "(start the master with torch imported, or library='torch')")


_NUMPY_METHODS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "matmul": np.matmul, "maximum": np.maximum, "minimum": np.minimum, "pow": np.power,
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos,
    "tanh": np.tanh, "floor": np.floor, "ceil": np.ceil, "sign": np.sign,
    "square": np.square, "abs": np.absolute, "neg": np.negative,
    "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    "relu": lambda a: np.maximum(a, np.zeros((), a.dtype)),
    "sum": _reduce(np.sum), "mean": _reduce(np.mean), "prod": _reduce(np.prod),
    "max": _reduce(np.max), "min": _reduce(np.min), "all": _reduce(np.all),
    "any": _reduce(np.any), "argmax": _arg_reduce(np.argmax), "argmin": _arg_reduce(np.argmin),
    "std": _moments(np.std), "var": _moments(np.var),
    "reshape": lambda a, *shape: a.reshape(_shape_args(shape)),
    "view": lambda a, *shape: a.reshape(_shape_args(shape)),
    "transpose": lambda a, d0, d1: np.swapaxes(a, d0, d1), "t": _t,
    "permute": lambda a, *dims: np.transpose(a, _shape_args(dims)),
    "flatten": lambda a: a.reshape(-1),
    "squeeze": lambda a, dim=None: np.squeeze(a) if dim is None else np.squeeze(a, axis=dim),
    "unsqueeze": np.expand_dims, "clone": np.copy,
    "contiguous": lambda a: np.asarray(a, order="C"),
    "to": _to, "astype": _to, "float": lambda a: a.astype("float32"),
    "double": lambda a: a.astype("float64"), "long": lambda a: a.astype("int64"),
    "int": lambda a: a.astype("int32"),
    "clamp": lambda a, min=None, max=None: np.clip(a, min, max),  # noqa: A002
    "clip": lambda a, min=None, max=None: np.clip(a, min, max),  # noqa: A002
    "where": np.where, "cpu": lambda a: a, "cuda": _no_cuda,
    "fill_": _fill, "zero_": lambda a: _fill(a, 0), "add_": _iop(operator.iadd),
    "sub_": _iop(operator.isub), "mul_": _iop(operator.imul), "div_": _iop(operator.itruediv),
    "pow_": _iop(operator.ipow), "copy_": _copy, "clamp_": _clamp_,
    "__getitem__": operator.getitem, "__setitem__": _setitem,
}

def numpy_names():
    """NumPy mode's table: its functions, plus the ``Tensor.*`` methods above."""
    by_name, by_fn = numpy_table()
    if "Tensor.add_" not in by_name:
        for k, f in _NUMPY_METHODS.items():
            by_name["Tensor." + k] = Entry("Tensor." + k, f)
    return by_name, by_fn


class NumpyLib:
    """Worker data as NumPy arrays (no torch needed)."""

    name = "numpy"

    def __init__(self):
        self.rng = np.random.default_rng()
        self.names = None

    def table(self):
        if self.names is None:
            self.names = numpy_names()[0]
        return self.names

    def seed(self, s):
        self.rng = np.random.default_rng(s)

    def is_array(self, x):
        return isinstance(x, np.ndarray)

    def const(self, c):
        kind, _, name = c.name.partition(":")
        if kind == "dtype":
            name = dtype_name(name)
            if name == "bfloat16":
                raise TypeError("bfloat16 needs torch on the workers")
            return np.dtype(name)
        if kind == "device" and name in ("cpu", "-1"):
            return "cpu"
        raise ValueError(f"NumPy workers do not know the constant {c.name!r}")

    def value(self, v):
        if v.dtype == "bfloat16":
            raise TypeError("bfloat16 needs torch on the workers")
        return v.array

    def result(self, r):
        """NumPy returns scalars for 0-d results: keep them on the node as 0-d arrays."""
        return np.asarray(r) if isinstance(r, np.generic) else r

    def alloc(self, kind, shape, dtype, value, device):
        if device >= 0:
            raise RuntimeError("this worker holds NumPy arrays: it has no CUDA device "
                               "(start the master with torch imported, or library='torch')")
        if dtype == "bfloat16":
            raise TypeError("bfloat16 needs torch on the workers")
        if kind == "empty":
            return np.empty(shape, dtype)
        if kind == "zeros":
            return np.zeros(shape, dtype)
        if kind == "ones":
            return np.ones(shape, dtype)
        if kind == "full":
            return np.full(shape, value, dtype)
        if dtype not in ("float32", "float64"):
            raise TypeError(f"{kind} makes float32 or float64 tensors, not {dtype}")
        if kind == "rand":
            return self.rng.random(shape, dtype=dtype)
        if kind == "randn":
            return self.rng.standard_normal(shape, dtype=dtype)
        raise ValueError(f"unknown allocation {kind!r}")

    def meta(self, a):
        return tuple(a.shape), a.dtype.name, -1

    def host(self, a):
        """A contiguous host array with a's data (for sending)."""
        return np.asarray(a, order="C")

    def to_device(self, a, device):
        return _no_cuda(a)

    def set_grad(self, enabled):
        pass


def torch_consts(torch):
    """torch's named constants by their wire names ('dtype:float32', 'layout:strided'...)."""
    c = {}
    for n in DTYPES:
        c["dtype:" + n] = getattr(torch, n)  # the fixed names above
    for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc"):
        c["layout:" + n] = getattr(torch, n)
    for n in ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format"):
        c["memory_format:" + n] = getattr(torch, n)
    return c


class TorchLib:
    """Worker data as torch tensors (CPU, or CUDA after ``.cuda()``)."""

    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch
        self.gen = torch.Generator()
        self.names = None
        self.consts = None

    def table(self):
        if self.names is None:
            from .nn_worker import worker_entries
            names = dict(torch_table()[0])
            names.update(worker_entries())
            self.names = names
        return self.names

    def seed(self, s):
        self.gen.manual_seed(s)
        self.torch.manual_seed(s)  # the functions that take no generator (dropout, rand_like)

    def is_array(self, x):
        return isinstance(x, self.torch.Tensor)

    def dtype(self, name):
        return self._consts()["dtype:" + name]

    def _consts(self):
        if self.consts is None:
            self.consts = torch_consts(self.torch)
        return self.consts

    def const(self, c):
        v = self._consts().get(c.name)
        if v is not None:
            return v
        kind, _, name = c.name.partition(":")
        if kind == "device":
            return self.torch.device(name)  # parses 'cpu', 'cuda:0'...: a value, not code
        if kind == "dtype":
            return self.dtype(dtype_name(name))
        raise ValueError(f"unknown constant {c.name!r}")

    def value(self, v):
        torch = self.torch
        if v.dtype == "bfloat16":
            t = torch.from_numpy(v.array).view(torch.bfloat16)
        else:
            t = torch.from_numpy(v.array)
        return t.requires_grad_() if v.requires_grad else t

    def result(self, r):
        return r

    def alloc(self, kind, shape, dtype, value, device):
        torch = self.torch
        dt = self.dtype(dtype)
        if kind == "empty":
            t = torch.empty(shape, dtype=dt)
        elif kind == "zeros":
            t = torch.zeros(shape, dtype=dt)
        elif kind == "ones":
            t = torch.ones(shape, dtype=dt)
        elif kind == "full":
            t = torch.full(shape, value, dtype=dt)
        elif kind == "rand":
            t = torch.rand(shape, dtype=dt, generator=self.gen)
        elif kind == "randn":
            t = torch.randn(shape, dtype=dt, generator=self.gen)
        else:
            raise ValueError(f"unknown allocation {kind!r}")
        return t.cuda(device) if device >= 0 else t

    def meta(self, t):
        return tuple(t.shape), str(t.dtype)[6:], (t.device.index or 0) if t.is_cuda else -1

    def host(self, t):
        return t.detach().cpu().resolve_conj().resolve_neg().contiguous()

    def to_device(self, t, device):
        return t.cuda(device)

    def set_grad(self, enabled):
        self.torch.set_grad_enabled(enabled)


def make_lib(name):
    return TorchLib() if name == "torch" else NumpyLib()
