"""Reductions as the backends run them: AVG is SUM then a scale by 1/size, PREMUL_SUM(f) a
scale by f then SUM (:func:`reduce_plan`), and the scaling itself (:func:`scale`, in C
where ``engines._core`` is built)."""
from . import cuda as _cuda
from . import dtypes as D
from .reduce_op import PremulSum, op_code

_VALID = frozenset((d, o) for d in D.DTYPE_NAMES for o in range(D.PREMUL_SUM) if D.op_valid(d, o))
_SCALABLE = D.FLOATING | D.COMPLEX


def reduce_plan(op, dtype):
    """``(backend op code, factor to pre-scale by or None, post-scale by 1/size?)``.

    AVG is SUM then a scale by 1/size; PREMUL_SUM(f) is a scale by f then SUM.
    ValueError (before any communication) for an op the dtype does not support.
    """
    code = op_code(op)
    if code == D.AVG or code == D.PREMUL_SUM:
        if dtype not in _SCALABLE:
            raise ValueError(f"op={D.OP_NAMES[code]} needs a floating or complex tensor, got "
                             f"{D.DTYPE_NAMES[dtype]} (integer averages would be truncated)")
        if code == D.AVG:
            return D.SUM, None, True
        return D.SUM, premul_factor(op), False
    if (dtype, code) not in _VALID:
        raise ValueError(f"op={D.OP_NAMES[code]} is not defined for {D.DTYPE_NAMES[dtype]} tensors")
    return code, None, False


def premul_factor(op):
    f = op.factor if isinstance(op, PremulSum) else op
    if hasattr(f, "item"):
        if getattr(f, "numel", lambda: getattr(f, "size", 1))() != 1:
            raise ValueError("ReduceOp.PREMUL_SUM factor must be a number or a one-element tensor")
        f = f.item()
    if not isinstance(f, (int, float)) or isinstance(f, bool):
        raise ValueError(f"ReduceOp.PREMUL_SUM factor must be a real number, got {f!r}")
    return float(f)


# ---- scaling (AVG, PREMUL_SUM) -----------------------------------------------------------

def _load_scale():
    """``scale_ptr`` of the C kernels, else of their NumPy twin (the same bits: half types
    scaled in float32 and rounded once)."""
    try:
        from ..engines._core import scale_ptr
    except ImportError:  # extensions not built
        from .kernels_numpy import scale_ptr
    return lambda buf, factor: scale_ptr(buf.ptr, buf.count, buf.dtype, factor)


_scale_impl = None


def scale(buf, factor):
    """``buf *= factor`` in place (floating and complex dtypes)."""
    global _scale_impl
    if buf.device != -1:
        if buf.count:
            _cuda.device_view(buf).mul_(factor)
        return
    if _scale_impl is None:
        _scale_impl = _load_scale()
    if buf.count:
        _scale_impl(buf, factor)


__all__ = ["reduce_plan", "premul_factor", "scale"]
