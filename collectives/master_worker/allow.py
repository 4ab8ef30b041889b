"""What a worker may run: allow-lists built from the array libraries' own lists.

torch: every function ``torch.overrides.get_overridable_functions()`` lists (torch.*,
torch.Tensor methods and properties, torch.nn.functional, torch.linalg, torch.fft,
torch.special), and Tensor's other public methods (``new_ones``...), named
``<namespace>.<name>``. NumPy: its ufuncs (``numpy.exp``, and their
``reduce``/``accumulate``/``outer`` methods) and the functions of numpy, numpy.linalg and
numpy.fft that dispatch through ``__array_function__``. In torch mode NumPy's functions are
allowed too, given torch tensors (``np.concatenate([a, b])`` of remote torch tensors): NumPy
reads them on the node as it does locally (``Tensor.__array__``), and its result comes back
as NumPy gives it, an array (a sync point). Both modes: the Python operators
(``operator.pow``, ``operator.ipow``..., listed once in :mod:`.operators`). Both sides build the same table
from the same installed library, so a name means one function; the wire carries the name
and the worker looks it up in this table (never ``getattr`` on a string it was sent).

Refused even though the library lists them: private names, anything that reads or writes
files, pickles, hands out raw memory or runs a callable (``torch.save``/``load`` are not in
the lists at all; ``numpy.save``, ``numpy.load``... are; ``Tensor.storage``,
``Tensor.register_hook``, ``Tensor.apply_``... are).

Nothing here imports torch at module import: the tables are built on first use.
"""
import re

import collectives.master_worker.operators as operators
from .codec import encoded

# name tokens (split at '_' and '.') that mark file I/O, pickling, code or raw memory
_DENY_TOKENS = frozenset((
    "save", "savez", "savetxt", "load", "loadtxt", "file", "fromfile", "tofile", "hub", "pickle",
    "memmap", "genfromtxt", "fromregex", "storage", "hook", "hooks", "exec", "eval", "compile",
    "dlpack", "ptr", "cdata", "apply", "map", "map2", "share", "autocast", "sym",
    "ctypes", "printoptions"))
# Tensor's special methods that are plain tensor operations: the Python operators (one list,
# operators.py), indexing, and the Python 2 division spellings torch keeps
_TENSOR_DUNDERS = operators.dunders() | frozenset((
    "__getitem__", "__setitem__", "__len__", "__contains__", "__div__", "__idiv__", "__rdiv__"))
_SPLIT = re.compile(r"[._]+")


def refused(name):
    """Why ``name`` is refused even where the library lists it, or None."""
    last = name.rsplit(".", 1)[-1]
    if last.startswith("__") and last.endswith("__"):
        return None if last in _TENSOR_DUNDERS else "a special method"
    if last.startswith("_"):
        return "a private name"
    if any(tok in _DENY_TOKENS for tok in _SPLIT.split(name)[1:]):
        return "it reads or writes files, pickles, exposes memory or runs code"
    return None


class Entry:
    """One allowed name: the function, and whether it is a Tensor property (read by
    attribute access) or an in-place method (returns its first argument; by default told
    by the name: ``add_``, ``__iadd__``, ``__setitem__``)."""

    __slots__ = ("name", "fn", "prop", "inplace", "wire", "results")

    def __init__(self, name, fn, prop=False, inplace=None):
        self.name, self.fn, self.prop = name, fn, prop
        self.wire = encoded(name)  # the name as the codec writes it, once
        self.results = {}  # argument kinds -> what a call returns (the master's remote_call.py)
        if inplace is None:
            last = name.rsplit(".", 1)[-1]
            inplace = (last.endswith("_") and not last.endswith("__")) or (
                last.startswith("__i") and last not in ("__invert__",)) or last == "__setitem__"
        self.inplace = inplace


def _add_operators(by_name, array_type):
    """The Python operators' functions (operators.py) a node runs for remote tensors."""
    for name, f, in_place in operators.entries(array_type):
        by_name[name] = Entry(name, f, inplace=in_place)


# torch mode's own entries: build a module or optimizer on a node, and call one there
# (collectives/master_worker/nn_worker.py has the functions)
PACKAGE_FUNCTION_NAMES = (
    "collectives.module", "collectives.optimizer", "collectives.Module.__call__",
    "collectives.Module.train", "collectives.Module.zero_grad", "collectives.Module.state_dict",
    "collectives.Module.load_state_dict", "collectives.Optimizer.step",
    "collectives.Optimizer.zero_grad")
_TORCH = None
_NUMPY = None


def torch_table():
    """``(by_name, by_function)``: name -> Entry, function object -> name (torch mode)."""
    global _TORCH
    if _TORCH is None:
        import torch
        from torch.overrides import get_ignored_functions, get_overridable_functions
        by_name, by_fn = {}, {}

        def add(name, f, prop=False):
            if refused(name) is None and name not in by_name:
                by_name[name] = Entry(name, f, prop)
                if not prop:
                    by_fn.setdefault(f, name)

        order = [torch, torch.Tensor, torch.nn.functional, torch.linalg, torch.fft,
                 torch.special, torch.functional]
        found = get_overridable_functions()
        public = {}  # module -> {id(function): its public name there}
        for ns in (torch, torch.nn.functional, torch.linalg, torch.fft, torch.special):
            public[ns] = {id(f): a for a, f in vars(ns).items() if not a.startswith("_")}
        for ns in order + [k for k in found if k not in order]:
            funcs = found.get(ns, ())
            if isinstance(ns, type) and ns is torch.Tensor:
                prefix, names = "torch.Tensor", {}
            elif hasattr(ns, "__file__"):
                home = torch if ns is torch.functional else ns
                prefix, names = home.__name__, public.get(home, {})
            else:  # a Tensor property's descriptor: its getter is listed
                pname = getattr(ns, "__name__", None)
                if isinstance(pname, str):
                    add("torch.Tensor." + pname, _getter(pname), prop=True)
                continue
            for f in funcs:
                attr = names.get(id(f)) or getattr(f, "__name__", None)
                if isinstance(attr, str):
                    add(f"{prefix}.{attr}", f)
        # the public functions of the math namespaces the list leaves out (F.hardswish...)
        for ns in (torch.nn.functional, torch.linalg, torch.fft, torch.special):
            for attr, f in vars(ns).items():
                if not attr.startswith("_") and callable(f) and not isinstance(f, type) \
                        and getattr(f, "__module__", "").startswith("torch"):
                    add(f"{ns.__name__}.{attr}", f)
        # torch's ATen bindings the list leaves out (torch.zero_, torch.resize_as_) and its
        # factories (ignored by __torch_function__: they take no tensor), for
        # mw.call(torch.arange, 5, node=k): C functions of torch._C._VariableFunctions only
        aten = frozenset(dir(torch._C._VariableFunctions))
        for f in list(get_ignored_functions()) + [vars(torch).get(a) for a in aten]:
            attr = getattr(f, "__name__", "")
            if attr in aten and not attr.startswith(("set", "_", "is_")) \
                    and vars(torch).get(attr) is f:
                add("torch." + attr, f)
        for attr in dir(torch.Tensor):  # Tensor's public methods the list leaves out (new_ones...)
            if attr.startswith("_"):
                continue
            f = getattr(torch.Tensor, attr)  # a name from dir(), at build time, not the wire
            if callable(f) and not isinstance(f, type):
                add("torch.Tensor." + attr, f)
        for d in sorted(operators.dunders()):  # by their own names too (__pow__ is pow)
            f = getattr(torch.Tensor, d, None)
            if f is not None:
                add("torch.Tensor." + d, f)
        _add_operators(by_name, torch.Tensor)
        for name, e in numpy_table()[0].items():  # NumPy's functions, given torch tensors
            if name.startswith("numpy."):
                by_name[name] = e
        _TORCH = (by_name, by_fn)
    return _TORCH


def _getter(pname):
    import operator
    return operator.attrgetter(pname)  # a fixed attribute, chosen here from torch's list


def numpy_table():
    """``(by_name, by_function)`` for NumPy mode: ufuncs and ``__array_function__``
    functions of numpy, numpy.linalg and numpy.fft."""
    global _NUMPY
    if _NUMPY is None:
        import numpy as np
        by_name, by_fn = {}, {}
        for ns, prefix in ((np, "numpy"), (np.linalg, "numpy.linalg"), (np.fft, "numpy.fft")):
            for attr in sorted(vars(ns)):
                f = vars(ns)[attr]
                name = f"{prefix}.{attr}"
                if isinstance(f, np.ufunc):
                    if refused(name) is not None:
                        continue
                    by_name[name] = Entry(name, f)
                    by_fn.setdefault(f, name)
                    if f.nin == 2 and f.nout == 1:
                        for meth in ("reduce", "accumulate", "outer", "reduceat"):
                            by_name[f"{name}.{meth}"] = Entry(f"{name}.{meth}", getattr(f, meth))
                elif hasattr(f, "_implementation") and callable(f):
                    if refused(name) is not None:
                        continue
                    by_name[name] = Entry(name, f)
                    by_fn.setdefault(f, name)
        _add_operators(by_name, np.ndarray)
        _NUMPY = (by_name, by_fn)
    return _NUMPY

