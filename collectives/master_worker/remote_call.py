"""The master's side of a remote call: any allowed function, named on the wire.

A call whose arguments include remote tensors runs on their node (all of them on one
node). Its arguments travel structurally: numbers, str, None, slices, Ellipsis, nested
tuples/lists/dicts, dtypes/devices/layouts (as named constants), shapes (as tuples),
remote tensors (as handles) and local tensors or arrays up to :data:`LOCAL_MAX` bytes (by
value). The result:

* a tensor -> a remote tensor at once (the call is queued);
* a named tuple of tensors (``max(dim)``, ``topk``, ``sort``, ``linalg.svd``...) -> the same
  named tuple of remote tensors, at once;
* ``None`` (``backward``, ``optimizer.step``...) -> None, at once;
* anything else (a Python number or bool, a shape, a tuple whose length depends on the
  data such as ``split`` or ``unique(return_counts=True)``) -> a sync point: the master
  waits for the node and gets the value (tensors inside it as remote tensors).

Which of these a call gives is learned from its first call with the same argument kinds
(the function's name, which arguments are remote tensors, the values of bool/None/str
arguments, the keyword names): that first call is a sync point, later ones are queued.
Reading a Tensor property other than a tensor-valued one (``.grad`` included) is always a
sync point.
"""
import sys

import numpy as np

import collectives.master_worker.protocol as P
from .allow import PACKAGE_FUNCTION_NAMES, Entry, numpy_table, refused, torch_table
from .codec import Const, TensorValue
from .master import RemoteError, current_node, get_master
import collectives.master_worker.operators as operators
from .ops import dtype_name, numpy_names, torch_consts

LOCAL_MAX = 1 << 20   # local tensors/arrays up to this many bytes travel by value
_TENSOR, _NONE = 1, 2
_RESHAPING = frozenset("torch.Tensor." + n for n in (
    "resize_", "resize_as_", "t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_",
    "swapaxes_", "as_strided_", "set_"))
_TENSOR_PROPS = frozenset(("T", "mT", "H", "mH", "real", "imag", "data"))
Handle = None         # RemoteTensor (set by tensor.py)
KEYED = set()         # handle types whose calls are told apart by the object (modules...)


# ---- names -------------------------------------------------------------------------------------
def table(m):
    """The master's allow-list for its library: name -> Entry."""
    t = m.names
    if t is None:
        if m.lib == "torch":  # and the names that call modules/optimizers on a node
            t = dict(torch_table()[0])
            t.update((k, Entry(k, None)) for k in PACKAGE_FUNCTION_NAMES)
        else:
            t = numpy_names()[0]
        m.names = t
    return t


def entry_of(m, name):
    """The Entry for ``name``; ValueError (before anything is sent) when it is refused."""
    e = table(m).get(name)
    if e is None:
        why = refused(name)
        lists = ("torch.overrides.get_overridable_functions() and Tensor's methods"
                 if m.lib == "torch" else "NumPy's ufuncs and __array_function__ functions")
        raise ValueError(f"{name!r} cannot run on a worker: "
                         + (f"refused ({why})" if why else f"it is not in the allow-list "
                            f"({lists})"))
    return e


def method_entry(m, attr):
    """The Entry of a tensor method or property ``attr``; AttributeError if none."""
    e = m.methods.get(attr)
    if e is None:
        name = ("torch.Tensor." if m.lib == "torch" else "Tensor.") + attr
        e = table(m).get(name)
        if e is None:
            why = refused(name)
            raise AttributeError(f"'RemoteTensor' object has no attribute {attr!r}"
                                 + (f" (refused on workers: {why})" if why else
                                    f" ({name} is not a function workers run in "
                                    f"{m.lib} mode)"))
        m.methods[attr] = e
    return e


def name_of_function(m, func):
    """The qualified name of a torch or NumPy function object (allow-listed), or raise."""
    by_fn = torch_table()[1] if m.lib == "torch" else numpy_table()[1]
    name = by_fn.get(func)
    if name is None and m.lib == "torch" and getattr(func, "__qualname__", "").startswith(
            "_VariableFunctionsClass."):  # torch.X's class-level twin, as torch passes it
        name = "torch." + func.__name__
    if name is None:
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise ValueError(f"{getattr(func, '__module__', '')}.{what} cannot run on a worker: "
                         "it is not in the allow-list of functions remote tensors take")
    return entry_of(m, name)


def operator_entry(m, key):
    """The Entry that runs a Python operator on a node: ``key`` is its name in
    :data:`.operators.OPERATORS` (``add``, ``and_``: forward and reflected forms, the
    reflected ones with their operands swapped) or ``i`` + that name (``iadd``: in place).
    False for a form the library's arrays lack: in place (torch's ``@=``), Python then
    rebinds ``a = a @ b``; forward (torch's ``divmod``), Python raises its TypeError."""
    e = m.operators.get(key)
    if e is None:
        op = operators.BY_NAME.get(key)
        if op is not None:
            e = table(m).get(op.wire, False)
        else:
            op = operators.BY_NAME[key[1:]]
            e = table(m).get(op.inplace_wire, False)
        m.operators[key] = e
    return e


# ---- arguments ------------------------------------------------------------------------------------
class _Where:
    """The node a call's remote arguments are on (the first one seen), for the check."""

    __slots__ = ("nd", "what")

    def __init__(self):
        self.nd = self.what = None


_PLAIN = frozenset((int, float, bool, str, type(None), complex, bytes, type(Ellipsis)))


def _name(what):
    return f"argument {what}" if type(what) is int else what


def _check_node(w, nd, what):
    """Remember the first remote argument's node; ValueError naming both if they differ."""
    if w.nd is None:
        w.nd, w.what = nd, what
    elif nd is not w.nd:
        raise ValueError(f"{_name(what)} is on node {nd.index}, {_name(w.what)} on node "
                         f"{w.nd.index}: all remote tensors of a call must be on one node "
                         "(move one explicitly with .to_node(k))")


def _conv(v, w, what):
    """``v`` as plain data for the wire (``what`` names it in errors: an argument's index,
    or a description)."""
    t = type(v)
    if t in _PLAIN:
        return v
    if t is Handle:
        _check_node(w, v._nd, what)
        return v._ref()
    if t is tuple or t is list:
        return t([_conv(x, w, f"{_name(what)}[{i}]") for i, x in enumerate(v)])
    if t is dict:
        return {k: _conv(x, w, f"{_name(what)}[{k!r}]") for k, x in v.items()}
    if t is slice:
        return slice(_conv(v.start, w, what), _conv(v.stop, w, what), _conv(v.step, w, what))
    return _conv_other(v, w, what)


def _conv_other(v, w, what):
    if isinstance(v, Handle):
        return _conv(v, w, what)
    ref = getattr(v, "_mw_ref", None)  # a module or optimizer handle
    if ref is not None:
        return _conv(ref, w, what)
    what = _name(what)
    if isinstance(v, np.ndarray):
        if v.nbytes > LOCAL_MAX:
            raise TypeError(_too_big(what, v.nbytes))
        if v.dtype.name not in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16",
                                "uint32", "uint64", "float16", "float32", "float64",
                                "complex64", "complex128"):
            raise TypeError(f"{what}: arrays of dtype {v.dtype} cannot be sent")
        return np.ascontiguousarray(v)
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (np.dtype, type)) and _is_numpy_dtype(v):
        return Const("dtype:" + np.dtype(v).name)
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(v, torch.Tensor):
            n = v.numel() * v.element_size()
            if n > LOCAL_MAX:
                raise TypeError(_too_big(what, n))
            src = v.detach().cpu().contiguous()
            dt = str(src.dtype)[6:]
            arr = src.view(torch.int16).numpy().view(np.uint16) if dt == "bfloat16" else src.numpy()
            return TensorValue(arr, dt, False)
        if isinstance(v, torch.dtype):
            return Const("dtype:" + dtype_name(v))
        if isinstance(v, torch.device):
            return Const("device:" + str(v))
        if isinstance(v, (torch.layout, torch.memory_format)):
            return Const(("layout:" if isinstance(v, torch.layout) else "memory_format:")
                         + str(v)[6:])
        if isinstance(v, torch.Size):
            return tuple(int(d) for d in v)
        if isinstance(v, torch.Generator):
            raise TypeError(f"{what}: a torch.Generator cannot be sent (seed the nodes' "
                            "generators with mw.manual_seed)")
    if isinstance(v, (tuple, list)):  # named tuples, subclasses
        return tuple(_conv(x, w, f"{what}[{i}]") for i, x in enumerate(v))
    if isinstance(v, (int, float, complex, str)):
        return v
    raise TypeError(f"{what}: a {type(v).__name__} cannot be sent to a worker (send None, "
                    "numbers, str, tuples, lists, dicts, slices, dtypes, devices, remote "
                    f"tensors, or local tensors up to {LOCAL_MAX} bytes)")


def _is_numpy_dtype(v):
    try:
        return isinstance(v, np.dtype) or issubclass(v, np.generic)
    except TypeError:
        return False


def _too_big(what, n):
    return (f"{what} is a local tensor of {n} bytes: only local tensors up to {LOCAL_MAX} "
            "bytes travel with a call; send larger ones first (mw.send(x, node=k))")


def _kind(v):
    t = type(v)
    if t is Handle:
        return "T"
    if t is bool or t is str or v is None:
        return v
    if t is tuple or t is list:
        return "L"
    if t in KEYED:
        return v._mw_key
    return t


# ---- issuing ----------------------------------------------------------------------------------------
def call_entry(m, e, args, kwargs, node=None):
    """Run Entry ``e`` with ``args``/``kwargs`` on the node of their remote tensors."""
    w = _Where()
    a, kinds = [], []
    i = 0
    for x in args:  # the common kinds inline: this is every call's path
        t = type(x)
        if t is Handle:
            if w.nd is None:
                w.nd, w.what = x._nd, i
            elif x._nd is not w.nd:
                _check_node(w, x._nd, i)  # raises, naming both nodes
            a.append(x._ref())
            kinds.append("T")
        elif t is int or t is float:
            a.append(x)
            kinds.append(t)
        else:
            a.append(_conv(x, w, i))
            kinds.append(_kind(x))
        i += 1
    a = tuple(a)
    k = {n: _conv(x, w, f"argument {n!r}") for n, x in kwargs.items()} if kwargs else None
    nd = w.nd
    if nd is None:
        nd = m.node(current_node() if node is None else node)
    elif node is not None and m.node(node) is not nd:
        raise ValueError(f"node={node}, but the call's remote tensors are on node {nd.index}")
    if m.torch is not None:
        g = m.torch.is_grad_enabled()
        if g is not nd.grad:
            m.command(nd, P.C_GRAD, (g,))
            nd.grad = g
    name, wire = e.name, e.wire
    if e.inplace and args and type(args[0]) is Handle:
        m.command(nd, P.C_CALL, (wire, -1, a) if k is None else (wire, -1, a, k))
        if name in _RESHAPING:
            args[0]._meta = None  # its shape changes: ask the node when needed
        return args[0]
    if e.prop and name.rsplit(".", 1)[1] not in _TENSOR_PROPS:
        return _sync(m, nd, name, a, k)
    key = tuple(kinds) if not kwargs else (tuple(kinds), tuple([(n, _kind(x)) for n, x in
                                                                 kwargs.items()]))
    mode = e.results.get(key)
    if mode is _TENSOR:
        out = next(nd.hids)
        m.command(nd, P.C_CALL, (wire, out, a) if k is None else (wire, out, a, k))
        return Handle(m, nd, out)
    if mode is _NONE:
        m.command(nd, P.C_CALL, (wire, -1, a) if k is None else (wire, -1, a, k))
        return None
    if mode is not None:  # a named tuple of tensors
        typ, n = mode
        outs = [next(nd.hids) for _ in range(n)]
        m.command(nd, P.C_CALL, (wire, outs, a, k))
        return typ([Handle(m, nd, h) for h in outs])
    return _sync(m, nd, name, a, k, e.results, key)


def _sync(m, nd, name, a, k, results=None, key=None):
    out = next(nd.hids)

    def handler(ok, payload):
        if not ok:
            raise RemoteError(nd.index, [(-1, name, payload, [])])
        return payload
    e = m.call(nd, P.C_CALLR, (name, out, a, k), handler, name)
    try:
        struct = m.resolve(nd, e)
    except RemoteError:
        m.check(nd)
        raise
    if struct[0] == "T":
        if results is not None:
            results[key] = _TENSOR
        return Handle(m, nd, out, (tuple(struct[1]), struct[2], struct[3]))
    if struct[0] == "F":  # it failed: a failed handle, raised at the next sync point
        return Handle(m, nd, out)
    m.check(nd)  # a value: a sync point
    handles = []
    value = _build(m, nd, struct, handles)
    if handles:
        m.command(nd, P.C_BIND, (out, [h._hid for h in handles]))
    if results is not None:
        if struct[0] == "V" and struct[1] is None:
            results[key] = _NONE
        elif struct[0] == "R" and all(s[0] == "T" for s in struct[2]):
            results[key] = (type(value), len(struct[2]))
    return value


def _build(m, nd, s, handles):
    kind = s[0]
    if kind == "T":
        h = Handle(m, nd, next(nd.hids), (tuple(s[1]), s[2], s[3]))
        handles.append(h)
        return h
    if kind == "V":
        return s[1]
    if kind in ("tuple", "list"):
        items = [_build(m, nd, x, handles) for x in s[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _build(m, nd, x, handles) for k, x in s[1].items()}
    if kind == "R":
        items = [_build(m, nd, x, handles) for x in s[2]]
        typ = _return_types(m).get(s[1])
        return typ(items) if typ is not None else tuple(items)
    torch = m.torch
    if kind == "S":
        return torch.Size(s[1]) if torch is not None else tuple(s[1])
    if kind == "D":
        return getattr(torch, dtype_name(s[1])) if torch is not None else np.dtype(s[1])
    if kind == "E":
        return torch.device(s[1])
    if kind == "C":  # a layout or memory format, by name in a fixed table
        return _torch_consts(m).get(s[1], s[1])
    raise ValueError(f"unknown result kind {kind!r} from node {nd.index}")


def _torch_consts(m):
    if m.consts is None:
        m.consts = torch_consts(m.torch)
    return m.consts


def _return_types(m):
    if m.return_types is None:
        import torch.return_types as rt
        m.return_types = {n: getattr(rt, n) for n in rt.__all__
                          if isinstance(getattr(rt, n), type)}
    return m.return_types


def method(t, attr, args, kwargs):
    """``t.<attr>(*args, **kwargs)`` on t's node."""
    m = t._m
    return call_entry(m, m.methods.get(attr) or method_entry(m, attr), (t,) + args, kwargs)


def call(fn, *args, node=None, **kwargs):
    """Run ``fn`` (a torch or NumPy function, or its qualified name such as
    ``'torch.matmul'``) on the node of its remote-tensor arguments (or ``node``, when it
    has none): what a torch function called on remote tensors does, spelled out.

    Names outside the workers' allow-list raise ValueError here, before anything is sent.

    Example:
        >>> mw.call(torch.arange, 6, node=1)      # a tensor made on node 1
        >>> mw.call("torch.matmul", a, b)
    """
    m = get_master()
    if isinstance(fn, str):
        e = entry_of(m, fn)
    elif callable(fn):
        e = name_of_function(m, fn)
    else:
        raise TypeError(f"fn must be a function or a qualified name, got {type(fn).__name__}")
    return call_entry(m, e, args, kwargs, node)


def torch_function(func, args, kwargs):
    m = get_master()
    return call_entry(m, name_of_function(m, func), args, kwargs)


def array_function(func, args, kwargs):
    """A NumPy function given remote tensors (``np.concatenate([a, b])``): NumPy's own on
    their node, on torch tensors too in torch mode (allow.py)."""
    m = get_master()
    name = numpy_table()[1].get(func)
    if name is None:
        return name_of_function(m, func)  # raises, naming it
    return call_entry(m, entry_of(m, name), args, kwargs)


def array_ufunc(ufunc, method_name, inputs, kwargs):
    m = get_master()
    name = f"numpy.{ufunc.__name__}" + ("" if method_name == "__call__" else "." + method_name)
    if m.lib == "torch" and method_name == "__call__":
        # the torch function of the same name (np.exp(t) -> torch.exp(t)); NumPy's own
        # ufunc on the torch tensors where torch has none
        torch_name = "torch." + operators.UFUNC_TO_TORCH.get(ufunc.__name__, ufunc.__name__)
        if torch_name in table(m):
            name = torch_name
    if "out" in kwargs:
        raise TypeError("out= with remote tensors is not supported (assign the result)")
    return call_entry(m, entry_of(m, name), inputs, kwargs)


__all__ = ["call", "LOCAL_MAX"]
