"""The Python operators a remote tensor takes, listed once.

Each row names an operator by the :mod:`operator` module's function for it (``add``,
``and_``...) and gives its spelling, its forward, reflected and in-place special methods,
the NumPy ufunc and the torch function it is (what ``np.add(t)`` means in torch mode).
The rest derive from :data:`OPERATORS`:

* ``RemoteTensor``'s operator methods (``tensor.py``): every forward, reflected and
  in-place form;
* the functions a worker runs for them (:func:`entries`, added to both allow-lists by
  ``allow.py``): ``a ** b`` runs ``operator.pow(a, b)`` on the node, ``2 ** a`` runs
  ``operator.pow(2, a)`` and ``a **= 2`` runs ``operator.ipow(a, 2)``, so a node does what
  Python does with local tensors or arrays, reflection and fallbacks included;
* the Tensor special methods the torch allow-list accepts (:func:`dunders`), for the
  calls torch itself makes through ``__torch_function__`` (``local ** remote``);
* the ufunc-to-torch names of NumPy's ufuncs on torch-mode remote tensors
  (:data:`UFUNC_TO_TORCH`).
"""
import builtins
import operator
from typing import NamedTuple, Optional


class Operator(NamedTuple):
    """One Python operator (see the module docstring)."""

    name: str                 # the operator module's function: 'add', 'and_', 'neg'
    symbol: str               # as Python spells it: '+', '**', 'abs()'
    forward: str              # '__add__'
    reflected: Optional[str]  # '__radd__'; None: unary, or a comparison (Python swaps those)
    inplace: Optional[str]    # '__iadd__'; None where Python has no in-place form
    ufunc: str                # NumPy's ufunc: 'add'
    torch: Optional[str]      # the torch function the ufunc is in torch mode: 'add'

    @property
    def arity(self):
        return 1 if self.name in _UNARY else 2

    def function(self):
        """The function a node runs for the forward and reflected forms."""
        return builtins.divmod if self.name == "divmod" else getattr(operator, self.name)

    def inplace_function(self):
        """The operator module's in-place function (``operator.iadd``), or None."""
        return None if self.inplace is None else getattr(operator, "i" + self.name.rstrip("_"))

    @property
    def wire(self):
        """The allow-list name of the forward (and reflected) form."""
        return ("builtins." if self.name == "divmod" else "operator.") + self.name

    @property
    def inplace_wire(self):
        """The allow-list name of the in-place form, or None."""
        return None if self.inplace is None else "operator.i" + self.name.rstrip("_")


def _binary(name, symbol, ufunc, torch=None, key=None):
    key = key or name.rstrip("_")
    return Operator(name, symbol, f"__{key}__", f"__r{key}__", f"__i{key}__", ufunc,
                    torch or ufunc)


def _compare(name, symbol, ufunc, torch):
    return Operator(name, symbol, f"__{name}__", None, None, ufunc, torch)


def _unary(name, symbol, ufunc, torch):
    return Operator(name, symbol, f"__{name}__", None, None, ufunc, torch)


_UNARY = frozenset(("neg", "pos", "abs", "invert"))

OPERATORS = (
    _binary("add", "+", "add"),
    _binary("sub", "-", "subtract"),
    _binary("mul", "*", "multiply"),
    _binary("truediv", "/", "divide"),
    _binary("floordiv", "//", "floor_divide"),
    _binary("mod", "%", "remainder"),
    _binary("pow", "**", "power", "pow"),
    _binary("matmul", "@", "matmul"),
    _binary("and_", "&", "bitwise_and"),
    _binary("or_", "|", "bitwise_or"),
    _binary("xor", "^", "bitwise_xor"),
    _binary("lshift", "<<", "left_shift", "bitwise_left_shift"),
    _binary("rshift", ">>", "right_shift", "bitwise_right_shift"),
    Operator("divmod", "divmod()", "__divmod__", "__rdivmod__", None, "divmod", None),
    _compare("eq", "==", "equal", "eq"),  # torch.equal is one bool, not the ufunc
    _compare("ne", "!=", "not_equal", "ne"),
    _compare("lt", "<", "less", "lt"),
    _compare("le", "<=", "less_equal", "le"),
    _compare("gt", ">", "greater", "gt"),
    _compare("ge", ">=", "greater_equal", "ge"),
    _unary("neg", "-", "negative", "neg"),
    _unary("pos", "+", "positive", "positive"),
    _unary("abs", "abs()", "absolute", "abs"),
    _unary("invert", "~", "invert", "bitwise_not"),
)
BY_NAME = {op.name: op for op in OPERATORS}

#: NumPy ufuncs as torch functions of another name (torch mode: ``np.power(t, 2)`` is
#: ``torch.pow(t, 2)``); the operators' ufuncs, and ``true_divide``
UFUNC_TO_TORCH = {op.ufunc: op.torch for op in OPERATORS
                  if op.torch is not None and op.torch != op.ufunc}
UFUNC_TO_TORCH["true_divide"] = "true_divide"


def dunders():
    """Every special method of the operators (forward, reflected, in-place)."""
    out = set()
    for op in OPERATORS:
        out.update(d for d in (op.forward, op.reflected, op.inplace) if d is not None)
    return frozenset(out)


def _in_place(f, name):
    def run(a, b):
        r = f(a, b)
        if r is not a:  # the type's in-place method gave up: Python would rebind the name
            raise TypeError(f"{name} did not work in place on a {type(a).__name__} "
                            f"(given a {type(b).__name__})")
        return r
    run.__name__ = run.__qualname__ = name.rsplit(".", 1)[1]
    return run


def entries(array_type):
    """``[(name, function, in_place)]``: what a node runs for the operators, for arrays of
    ``array_type`` (``torch.Tensor``, ``numpy.ndarray``). Forms the type lacks are left
    out: an in-place one (torch's ``@=``) is then ``a = a @ b``, as Python does, and a
    forward one (torch's ``divmod``) raises Python's TypeError."""
    out = []
    for op in OPERATORS:
        if not hasattr(array_type, op.forward):
            continue
        out.append((op.wire, op.function(), False))
        if op.inplace is not None and hasattr(array_type, op.inplace):
            out.append((op.inplace_wire, _in_place(op.inplace_function(), op.inplace_wire),
                        True))
    return out


__all__ = ["OPERATORS", "BY_NAME", "Operator", "UFUNC_TO_TORCH", "dunders", "entries"]
