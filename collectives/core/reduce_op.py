"""Reduction operators, spelled as torch.distributed spells them.

``ReduceOp.SUM`` and friends are int-like (their int value is the op code in
:mod:`collectives.core.dtypes`); ``ReduceOp.PREMUL_SUM(factor)`` carries a factor.
"""
import enum
import warnings

from . import dtypes as D


# the op codes, as torch's ``ReduceOp.RedOpType``: one member per name of dtypes.OP_NAMES
# (the one list of the ops: the kernels' codes and their names)
RedOpType = enum.IntEnum("RedOpType", [(name, code) for code, name in sorted(D.OP_NAMES.items())],
                         module=__name__, qualname="RedOpType")
RedOpType.__doc__ = "The op codes, as torch's ``ReduceOp.RedOpType``."


class PremulSum(int):
    """``ReduceOp.PREMUL_SUM(factor)``: multiply every input by ``factor``, then sum.

    ``factor`` is a number or a one-element tensor/array.
    """

    def __new__(cls, factor):
        self = int.__new__(cls, D.PREMUL_SUM)
        self.factor = factor
        return self

    def __repr__(self):
        return f"ReduceOp.PREMUL_SUM({self.factor!r})"


class _PremulSumMember(int):
    """``ReduceOp.PREMUL_SUM``: equals the code; call it with a factor to use it."""

    def __new__(cls):
        return int.__new__(cls, D.PREMUL_SUM)

    def __call__(self, factor):
        return PremulSum(factor)

    def __repr__(self):
        return "<RedOpType.PREMUL_SUM: 8>"


class ReduceOp:
    """Reduction operators for all_reduce, reduce, reduce_scatter.

    Example:
        >>> dist.all_reduce(t, op=dist.ReduceOp.MAX)
        >>> dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM(0.5))
    """

    RedOpType = RedOpType
    # SUM ... BXOR: RedOpType's members (set below, from its one list); PREMUL_SUM takes a factor
    PREMUL_SUM = _PremulSumMember()

    def __new__(cls, op=RedOpType.SUM):
        # ReduceOp(ReduceOp.MAX) is accepted by torch; the member itself is our value
        return op_code(op) if not isinstance(op, PremulSum) else op


for _m in RedOpType:
    if _m != D.PREMUL_SUM:
        setattr(ReduceOp, _m.name, _m)
del _m

_MEMBERS = sorted(RedOpType, key=int)  # code -> member (the codes are 0..PREMUL_SUM)


def op_code(op, name="op"):
    """The int code of ``op`` (a ReduceOp member, PREMUL_SUM(factor), a plain int code, or
    torch.distributed's ReduceOp other than its PREMUL_SUM).

    Raises ValueError for anything else, and for PREMUL_SUM without a factor.
    """
    if type(op) is RedOpType:  # ReduceOp.SUM and the others: the common case first
        return op
    if isinstance(op, PremulSum):
        return D.PREMUL_SUM
    if type(op) is _PremulSumMember:
        raise ValueError(f"{name}=ReduceOp.PREMUL_SUM needs a factor: use ReduceOp.PREMUL_SUM(factor)")
    if isinstance(op, int) and not isinstance(op, bool) and 0 <= op < D.PREMUL_SUM:
        return _MEMBERS[op]  # (RedOpType(op) costs ~0.5 us: Enum's lookup machinery)
    if type(op).__module__.startswith("torch"):  # torch.distributed's ReduceOp, or a member
        kind = getattr(getattr(op, "op", op), "name", None)
        if kind in RedOpType.__members__:
            return RedOpType[kind]
    raise ValueError(f"{name} must be a ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, "
                     f"PREMUL_SUM(factor)), got {op!r}")


def as_op(op):
    """Our ReduceOp for torch.distributed's (a ReduceOp, one of its RedOpType members, or
    PREMUL_SUM with its factor); any other value as it is (op_code checks it where it is
    used). torch's PREMUL_SUM without a factor becomes ours without one, which op_code
    refuses with a message saying so."""
    if not type(op).__module__.startswith("torch"):
        return op
    kind = getattr(getattr(op, "op", op), "name", None)
    if kind == "PREMUL_SUM":
        factor = getattr(op, "factor", None)
        if factor is None:
            return ReduceOp.PREMUL_SUM
        return PremulSum(float(factor.item() if hasattr(factor, "item") else factor))
    return _BY_NAME.get(kind, op)


_BY_NAME = {m.name: m for m in RedOpType}


def supports_complex(reduceOp):  # noqa: N803  (torch's argument name)
    """Whether ``reduceOp`` reduces complex tensors, as torch answers it: all but MAX, MIN,
    PRODUCT, BAND, BOR and BXOR (our CPU backends multiply complex numbers too, nccl does
    not, so a program that asks gets the answer that holds on every backend)."""
    if isinstance(reduceOp, PremulSum) or type(reduceOp) is _PremulSumMember:
        return True
    return op_code(reduceOp, "reduceOp") not in (RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT,
                                                 RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


class _DeprecatedReduceOp:
    """The deprecated ``reduce_op`` alias: works, and warns as torch does."""

    def __getattr__(self, key):
        warnings.warn("torch.distributed.reduce_op is deprecated, please use "
                      "torch.distributed.ReduceOp instead", FutureWarning, stacklevel=2)
        return getattr(ReduceOp, key)


reduce_op = _DeprecatedReduceOp()

__all__ = ["ReduceOp", "RedOpType", "PremulSum", "as_op", "reduce_op", "op_code", "supports_complex"]
