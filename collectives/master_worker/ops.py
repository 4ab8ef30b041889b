"""The operations a remote tensor supports: one table shared by master and workers, and
the two array libraries a worker may hold data in (NumPy, torch).

The master sends an operation as its index in :data:`OPS` (an opcode) with plain-data
arguments; the worker looks the index up here. Nothing outside this table can be run
on a worker through the tensor API (registered functions are the rpc side's).
"""
import operator

import numpy as np

# name -> kind; the opcode of an operation is its index in OPS
_TABLE = [
    # binary element-wise (broadcasting): (a, b)
    ("add", "binary"), ("sub", "binary"), ("mul", "binary"), ("truediv", "binary"),
    ("floordiv", "binary"), ("mod", "binary"), ("pow", "binary"), ("matmul", "binary"),
    ("eq", "binary"), ("ne", "binary"), ("lt", "binary"), ("le", "binary"), ("gt", "binary"),
    ("ge", "binary"), ("and", "binary"), ("or", "binary"), ("xor", "binary"),
    ("maximum", "binary"), ("minimum", "binary"),
    # unary: (a,)
    ("neg", "unary"), ("pos", "unary"), ("abs", "unary"), ("invert", "unary"), ("exp", "unary"),
    ("log", "unary"), ("sqrt", "unary"), ("sin", "unary"), ("cos", "unary"), ("tanh", "unary"),
    ("sigmoid", "unary"), ("relu", "unary"), ("floor", "unary"), ("ceil", "unary"),
    ("sign", "unary"), ("square", "unary"),
    # reductions: (a, dim, keepdim) ; std/var: (a, dim, keepdim, correction)
    ("sum", "reduce"), ("mean", "reduce"), ("prod", "reduce"), ("max", "reduce"),
    ("min", "reduce"), ("argmax", "reduce"), ("argmin", "reduce"), ("all", "reduce"),
    ("any", "reduce"), ("std", "reduce"), ("var", "reduce"),
    # the rest: their own arguments
    ("reshape", "other"), ("transpose", "other"), ("t", "other"), ("permute", "other"),
    ("flatten", "other"), ("squeeze", "other"), ("unsqueeze", "other"), ("getitem", "other"),
    ("clone", "other"), ("contiguous", "other"), ("astype", "other"), ("clip", "other"),
    ("where", "other"), ("cuda", "other"), ("cpu", "other"),
    # in place on their first argument (no new handle)
    ("fill_", "inplace"), ("zero_", "inplace"), ("add_", "inplace"), ("sub_", "inplace"),
    ("mul_", "inplace"), ("div_", "inplace"), ("pow_", "inplace"), ("copy_", "inplace"),
    ("clamp_", "inplace"), ("setitem", "inplace"),
]
OPS = [name for name, _ in _TABLE]
KIND = dict(_TABLE)
OPCODE = {name: i for i, name in enumerate(OPS)}

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


_BIN = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
        "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
        "pow": operator.pow, "matmul": operator.matmul, "eq": operator.eq, "ne": operator.ne,
        "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
        "and": operator.and_, "or": operator.or_, "xor": operator.xor}
_IOP = {"add_": operator.iadd, "sub_": operator.isub, "mul_": operator.imul,
        "div_": operator.itruediv, "pow_": operator.ipow}


class NumpyLib:
    """Worker data as NumPy arrays (no torch needed)."""

    name = "numpy"

    def __init__(self):
        self.rng = np.random.default_rng()

    def seed(self, s):
        self.rng = np.random.default_rng(s)

    def is_array(self, x):
        return isinstance(x, np.ndarray)

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

    def call(self, name, args):
        a = args[0]
        kind = KIND[name]
        if kind == "binary":
            b = args[1]
            if name == "maximum":
                r = np.maximum(a, b)
            elif name == "minimum":
                r = np.minimum(a, b)
            else:
                r = _BIN[name](a, b)
            return np.asarray(r)
        if kind == "unary":
            return np.asarray(self._unary(name, a))
        if kind == "reduce":
            dim, keep = args[1], args[2]
            f = {"sum": np.sum, "mean": np.mean, "prod": np.prod, "max": np.max, "min": np.min,
                 "all": np.all, "any": np.any}.get(name)
            if f is not None:
                return np.asarray(f(a, axis=dim, keepdims=keep))
            if name in ("std", "var"):
                f = np.std if name == "std" else np.var
                return np.asarray(f(a, axis=dim, keepdims=keep, ddof=args[3]))
            f = np.argmax if name == "argmax" else np.argmin
            return np.asarray(f(a, axis=dim, keepdims=keep))
        return np.asarray(self._other(name, a, args))

    def _unary(self, name, a):
        if name == "neg":
            return -a
        if name == "pos":
            return +a
        if name == "invert":
            return ~a
        if name == "sigmoid":
            return 1 / (1 + np.exp(-a))
        if name == "relu":
            return np.maximum(a, np.zeros((), a.dtype))
        return getattr(np, name)(a)

    def _other(self, name, a, args):
        if name == "reshape":
            return a.reshape(args[1])
        if name == "transpose":
            return np.swapaxes(a, args[1], args[2])
        if name == "t":
            if a.ndim > 2:
                raise ValueError(f"t() expects a tensor with <= 2 dimensions, got {a.ndim}")
            return a.T
        if name == "permute":
            return np.transpose(a, args[1])
        if name == "flatten":
            return a.reshape(-1)
        if name == "squeeze":
            return np.squeeze(a) if args[1] is None else np.squeeze(a, axis=args[1])
        if name == "unsqueeze":
            return np.expand_dims(a, args[1])
        if name == "getitem":
            return a[args[1]]
        if name == "clone":
            return a.copy()
        if name == "contiguous":
            return np.asarray(a, order="C")
        if name == "astype":
            if args[1] == "bfloat16":
                raise TypeError("bfloat16 needs torch on the workers")
            return a.astype(args[1])
        if name == "clip":
            return np.clip(a, args[1], args[2])
        if name == "where":
            return np.where(a, args[1], args[2])
        if name == "cuda":
            raise RuntimeError("this worker holds NumPy arrays: it has no CUDA device "
                               "(start the master with torch imported, or library='torch')")
        if name == "cpu":
            return a
        raise ValueError(f"unknown operation {name!r}")

    def inplace(self, name, a, args):
        if name == "fill_":
            a[...] = args[0]
        elif name == "zero_":
            a[...] = 0
        elif name in _IOP:
            _IOP[name](a, args[0])
        elif name == "copy_":
            np.copyto(a, args[0], casting="unsafe")
        elif name == "clamp_":
            np.clip(a, args[0], args[1], out=a)
        elif name == "setitem":
            a[args[0]] = args[1]
        else:
            raise ValueError(f"unknown operation {name!r}")


class TorchLib:
    """Worker data as torch tensors (CPU, or CUDA after ``.cuda()``)."""

    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch
        self.gen = torch.Generator()

    def seed(self, s):
        self.gen.manual_seed(s)

    def is_array(self, x):
        return isinstance(x, self.torch.Tensor)

    def dtype(self, name):
        return getattr(self.torch, name)

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
        return t.detach().cpu().contiguous()

    def call(self, name, args):
        torch = self.torch
        a = args[0]
        kind = KIND[name]
        if kind == "binary":
            b = args[1]
            if name in ("maximum", "minimum"):
                if not isinstance(b, torch.Tensor):
                    b = torch.tensor(b, dtype=a.dtype, device=a.device)
                if not isinstance(a, torch.Tensor):
                    a = torch.tensor(a, dtype=b.dtype, device=b.device)
                return getattr(torch, name)(a, b)
            return _BIN[name](a, b)
        if kind == "unary":
            if name in ("neg", "pos", "invert"):
                return {"neg": operator.neg, "pos": operator.pos, "invert": operator.invert}[name](a)
            return getattr(torch, name)(a)
        if kind == "reduce":
            dim, keep = args[1], args[2]
            kw = {} if dim is None else {"dim": dim}
            if name in ("std", "var"):
                return getattr(torch, name)(a, **kw, keepdim=keep, correction=args[3])
            if name in ("max", "min"):
                return getattr(torch, "a" + name)(a, dim=() if dim is None else dim, keepdim=keep)
            if name == "prod" and dim is None:
                return torch.prod(a) if not keep else torch.prod(a).reshape([1] * a.ndim)
            if name in ("all", "any") and dim is None:
                r = getattr(torch, name)(a)
                return r.reshape([1] * a.ndim) if keep else r
            return getattr(torch, name)(a, **kw, keepdim=keep)
        return self._other(name, a, args)

    def _other(self, name, a, args):
        torch = self.torch
        if name == "reshape":
            return a.reshape(args[1])
        if name == "transpose":
            return a.transpose(args[1], args[2])
        if name == "t":
            return a.t()
        if name == "permute":
            return a.permute(args[1])
        if name == "flatten":
            return a.flatten()
        if name == "squeeze":
            return a.squeeze() if args[1] is None else a.squeeze(args[1])
        if name == "unsqueeze":
            return a.unsqueeze(args[1])
        if name == "getitem":
            return a[args[1]]
        if name == "clone":
            return a.clone()
        if name == "contiguous":
            return a.contiguous()
        if name == "astype":
            return a.to(self.dtype(args[1]))
        if name == "clip":
            return torch.clamp(a, args[1], args[2])
        if name == "where":
            return torch.where(a, args[1], args[2])
        if name == "cuda":
            return a.cuda(args[1])
        if name == "cpu":
            return a.cpu()
        raise ValueError(f"unknown operation {name!r}")

    def inplace(self, name, a, args):
        if name == "fill_":
            a.fill_(args[0])
        elif name == "zero_":
            a.zero_()
        elif name in _IOP:
            _IOP[name](a, args[0])
        elif name == "copy_":
            a.copy_(args[0] if isinstance(args[0], self.torch.Tensor) else self.torch.as_tensor(args[0]))
        elif name == "clamp_":
            a.clamp_(args[0], args[1])
        elif name == "setitem":
            a[args[0]] = args[1]
        else:
            raise ValueError(f"unknown operation {name!r}")


def make_lib(name):
    return TorchLib() if name == "torch" else NumpyLib()
