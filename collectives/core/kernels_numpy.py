"""Pure-NumPy implementation of the ``_core`` kernel API: the reference and the fallback.

Same functions, same results (bit for bit; NaN payloads aside) and the same
exceptions as the Cython kernels in ``_core``; slower, and it holds the GIL.
The tests run both and compare. Semantics (see ``engines/kernels/reduce_kernels.c``):
half types compute in float32 and round to nearest-even; MIN/MAX give NaN if
either operand is NaN and the second operand on ties; integers wrap; bool SUM
is OR and PRODUCT is AND; complex PRODUCT is (ac - bd) + (ad + bc)i, no FMA.
"""
import operator

import numpy as np

from . import dtypes as D
from .tensors import Buffer, is_torch_tensor, to_buffer
from .views import view_numpy

#: Bytes per chunk of the chunked kernels (COLL_CHUNK_BYTES in reduce_kernels.h).
CHUNK_BYTES = 64 * 1024

_NP_NATIVE = {
    D.FLOAT16: np.float16, D.FLOAT32: np.float32, D.FLOAT64: np.float64,
    D.COMPLEX64: np.complex64, D.COMPLEX128: np.complex128, D.INT8: np.int8,
    D.UINT8: np.uint8, D.INT16: np.int16, D.INT32: np.int32, D.INT64: np.int64,
    D.BOOL: np.bool_,
}
_UNSIGNED = {D.INT8: np.uint8, D.UINT8: np.uint8, D.INT16: np.uint16, D.INT32: np.uint32,
             D.INT64: np.uint64}


# ---- argument checks (same exceptions and messages as _core) ------------------------
def _view(obj, name, writable):
    """(numpy view of the elements, dtype code); bfloat16 as uint16 bits."""
    if isinstance(obj, np.ndarray) and obj.dtype.isnative and obj.dtype.type in (
            np.float16, np.float32, np.float64, np.complex64, np.complex128, np.int8, np.uint8,
            np.int16, np.int32, np.int64, np.bool_, np.intc, np.longlong):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{name} must be contiguous (C order); call numpy.ascontiguousarray first")
        if writable and not obj.flags.writeable:
            raise ValueError(f"{name} must be writeable")
        return obj.reshape(-1), _np_code(obj)
    if is_torch_tensor(obj) and obj.is_complex() and (obj.is_conj() or obj.is_neg()):
        raise ValueError(f"{name} is a lazily conjugated/negated view; call .resolve_conj() "
                         f"(and .resolve_neg()) first")
    buf = obj if isinstance(obj, Buffer) else to_buffer(obj, name)
    if buf.device != -1:
        raise ValueError(f"{name} must be in host (CPU) memory, got CUDA device {buf.device}")
    return view_numpy(buf.ptr, buf.count, buf.dtype, buf.obj), buf.dtype


def _np_code(arr):
    t = arr.dtype
    if t.kind == "i" and t.itemsize == 4:
        return D.INT32
    if t.kind == "i" and t.itemsize == 8:
        return D.INT64
    for code, typ in _NP_NATIVE.items():
        if t.type is typ:
            return code
    raise TypeError(f"unsupported dtype {t}")


def _op_code(op):
    if isinstance(op, (bool, float, complex, str)):
        raise TypeError(f"op must be a reduction op (collectives.core.dtypes code or ReduceOp), "
                        f"got {type(op).__name__} {op!r}")
    try:
        code = operator.index(op)
    except TypeError:
        if not hasattr(type(op), "__int__"):
            raise TypeError(f"op must be a reduction op (collectives.core.dtypes code or ReduceOp), "
                            f"got {type(op).__name__}") from None
        code = int(op)
    if code in (D.AVG, D.PREMUL_SUM):
        raise ValueError(f"op {D.OP_NAMES[code]} is not an elementwise reduction; reduce with SUM, "
                         f"then scale(dst, factor)")
    if code < 0 or code > D.BXOR:
        raise ValueError(f"op must be one of SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR "
                         f"(codes 0, 2-7), got {code}")
    return code


def _dtype_arg(dtype):
    try:
        code = operator.index(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a collectives.core.dtypes code (int), "
                        f"got {type(dtype).__name__}") from None
    if code not in D.ITEMSIZE:
        raise ValueError(f"dtype must be a collectives.core.dtypes code 0-{D.BOOL}, got {code}")
    return code


def _check_op(dtype, op):
    if D.op_valid(dtype, op):
        return
    why = "complex numbers are unordered" if op in (D.MIN, D.MAX) else \
        "bitwise ops need an integer or bool dtype"
    raise ValueError(f"op {D.OP_NAMES[op]} is not defined for dtype {D.DTYPE_NAMES[dtype]} ({why})")


def _check_same(dcode, dview, scode, sview, name):
    if scode != dcode:
        raise TypeError(f"{name} has dtype {D.DTYPE_NAMES[scode]}, dst has "
                        f"{D.DTYPE_NAMES[dcode]}; they must match")
    if sview.size != dview.size:
        raise ValueError(f"{name} has {sview.size} elements, dst has {dview.size}; they must match")


def _addr(view):
    return view.__array_interface__["data"][0]


def _partial_overlap(a, b):
    pa, pb, n = _addr(a), _addr(b), a.nbytes
    return n > 0 and pa != pb and pa < pb + n and pb < pa + n


def _count_arg(count, name):
    n = operator.index(count)
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


def _ptr_arg(ptr, name, nbytes):
    try:
        p = operator.index(ptr)
    except TypeError:
        raise TypeError(f"{name} must be an int address, got {type(ptr).__name__}") from None
    if p == 0 and nbytes > 0:
        raise ValueError(f"{name} is a null pointer")
    return p


def _factor_arg(factor):
    if isinstance(factor, (bool, complex, np.complexfloating)) or \
            not isinstance(factor, (int, float, np.number)):
        raise TypeError(f"factor must be a real number, got {type(factor).__name__}")
    return float(factor)


# ---- the arithmetic ------------------------------------------------------------------
def bf16_to_f32(bits):
    """bfloat16 bits (uint16) to float32 values, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values):
    """float32 to bfloat16 bits: round to nearest-even, NaN -> 0x7FC0 (torch's rule)."""
    values = np.ascontiguousarray(values, np.float32)
    u = values.view(np.uint32)
    with np.errstate(over="ignore"):
        r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    r = r.astype(np.uint16)
    r[np.isnan(values)] = 0x7FC0
    return r


def _fminmax(a, b, is_min):
    with np.errstate(invalid="ignore", over="ignore"):
        pick = np.where(a < b if is_min else a > b, a, b)
        return np.where(np.isnan(a) | np.isnan(b), a + b, pick)


def _freduce(a, b, op):
    """op on real floating arrays of one dtype."""
    with np.errstate(all="ignore"):
        if op == D.SUM:
            return a + b
        if op == D.PRODUCT:
            return a * b
    return _fminmax(a, b, op == D.MIN)


def _apply(a, b, dtype, op):
    """op(a, b) elementwise for two flat views of ``dtype``; a new array."""
    with np.errstate(all="ignore"):  # overflow to inf, NaN and wrap-around are the semantics
        return _apply_quiet(a, b, dtype, op)


def _apply_quiet(a, b, dtype, op):
    if dtype in (D.FLOAT32, D.FLOAT64):
        return _freduce(a, b, op)
    if dtype == D.FLOAT16:
        with np.errstate(over="ignore"):
            return _freduce(a.astype(np.float32), b.astype(np.float32), op).astype(np.float16)
    if dtype == D.BFLOAT16:
        return f32_to_bf16(_freduce(bf16_to_f32(a), bf16_to_f32(b), op))
    if dtype in D.COMPLEX:
        if op == D.SUM:
            return a + b
        ar, ai, br, bi = a.real, a.imag, b.real, b.imag
        out = np.empty_like(a)
        with np.errstate(all="ignore"):
            out.real = ar * br - ai * bi
            out.imag = ar * bi + ai * br
        return out
    if dtype == D.BOOL:
        if op in (D.SUM, D.MAX, D.BOR):
            return np.logical_or(a, b)
        if op in (D.PRODUCT, D.MIN, D.BAND):
            return np.logical_and(a, b)
        return np.logical_xor(a, b)
    u = _UNSIGNED[dtype]
    if op == D.SUM:
        return (a.view(u) + b.view(u)).view(a.dtype)
    if op == D.PRODUCT:
        return (a.view(u) * b.view(u)).view(a.dtype)
    if op == D.MIN:
        return np.minimum(a, b)
    if op == D.MAX:
        return np.maximum(a, b)
    if op == D.BAND:
        return np.bitwise_and(a, b)
    if op == D.BOR:
        return np.bitwise_or(a, b)
    return np.bitwise_xor(a, b)


def _scaled(a, dtype, factor):
    with np.errstate(all="ignore"):
        if dtype == D.FLOAT64:
            return a * factor
        if dtype == D.FLOAT32:
            return a * np.float32(factor)
        if dtype == D.FLOAT16:
            return (a.astype(np.float32) * np.float32(factor)).astype(np.float16)
        if dtype == D.BFLOAT16:
            return f32_to_bf16(bf16_to_f32(a) * np.float32(factor))
        real = np.float32 if dtype == D.COMPLEX64 else np.float64
        g, z = real(factor), real(0)
        out = np.empty_like(a)
        out.real = a.real * g - a.imag * z
        out.imag = a.real * z + a.imag * g
        return out


def _scale_check(dtype, name):
    if dtype not in D.FLOATING and dtype not in D.COMPLEX:
        raise ValueError(f"{name} must have a floating or complex dtype to scale, got "
                         f"{D.DTYPE_NAMES[dtype]}")


# ---- the API -------------------------------------------------------------------------
def reduce_into(dst, src, op):
    """``dst = op(dst, src)`` elementwise, in place. See ``_core.reduce_into``."""
    code = _op_code(op)
    d, dcode = _view(dst, "dst", True)
    s, scode = _view(src, "src", False)
    _check_same(dcode, d, scode, s, "src")
    _check_op(dcode, code)
    if _partial_overlap(d, s):
        raise ValueError("src partially overlaps dst; pass the same buffer or disjoint ones")
    if d.size:
        d[...] = _apply(d, s, dcode, code)
    return dst


def reduce_many(dst, srcs, op):
    """``dst = op(srcs[0], srcs[1], ...)``, one source at a time. See ``_core.reduce_many``."""
    code = _op_code(op)
    if isinstance(srcs, (str, bytes)) or not hasattr(srcs, "__len__"):
        raise TypeError(f"srcs must be a sequence of arrays/tensors, got {type(srcs).__name__}")
    srcs = list(srcs)
    if not srcs:
        raise ValueError("srcs must hold at least one array/tensor")
    d, dcode = _view(dst, "dst", True)
    _check_op(dcode, code)
    views = []
    for i, src in enumerate(srcs):
        name = f"srcs[{i}]"
        s, scode = _view(src, name, False)
        _check_same(dcode, d, scode, s, name)
        if _partial_overlap(d, s):
            raise ValueError(f"{name} partially overlaps dst; a source may be dst itself, "
                             f"nothing in between")
        views.append(s)
    if d.size:
        acc = views[0].copy()
        for s in views[1:]:
            acc = _apply(acc, s, dcode, code)
        d[...] = acc
    return dst


def scale(dst, factor):
    """``dst *= factor`` in place. See ``_core.scale``."""
    f = _factor_arg(factor)
    d, dcode = _view(dst, "dst", True)
    _scale_check(dcode, "dst")
    if d.size:
        d[...] = _scaled(d, dcode, f)
    return dst


def reduce_buffers(dst, src, op):
    """``reduce_into`` on two Buffer objects."""
    if not isinstance(dst, Buffer):
        raise TypeError(f"dst must be a collectives.core.tensors.Buffer, got {type(dst).__name__}")
    if not isinstance(src, Buffer):
        raise TypeError(f"src must be a collectives.core.tensors.Buffer, got {type(src).__name__}")
    reduce_into(dst, src, op)
    return dst


def reduce_ptr(dst_ptr, src_ptr, count, dtype, op):
    """``dst[i] = op(dst[i], src[i])`` for ``count`` elements at two int addresses."""
    dt = _dtype_arg(dtype)
    code = _op_code(op)
    n = _count_arg(count, "count")
    d = _ptr_arg(dst_ptr, "dst_ptr", n)
    s = _ptr_arg(src_ptr, "src_ptr", n)
    _check_op(dt, code)
    if n:
        dv, sv = view_numpy(d, n, dt), view_numpy(s, n, dt)
        dv[...] = _apply(dv, sv, dt, code)


def reduce_many_ptr(dst_ptr, src_ptrs, count, dtype, op):
    """``dst = op(src_0, ..., src_k)`` for ``count`` elements at int addresses."""
    dt = _dtype_arg(dtype)
    code = _op_code(op)
    n = _count_arg(count, "count")
    d = _ptr_arg(dst_ptr, "dst_ptr", n)
    _check_op(dt, code)
    src_ptrs = list(src_ptrs)
    if not src_ptrs:
        raise ValueError("src_ptrs must hold at least one address")
    ptrs = [_ptr_arg(p, f"src_ptrs[{i}]", n) for i, p in enumerate(src_ptrs)]
    if n:
        acc = view_numpy(ptrs[0], n, dt).copy()
        for p in ptrs[1:]:
            acc = _apply(acc, view_numpy(p, n, dt), dt, code)
        view_numpy(d, n, dt)[...] = acc


def scale_ptr(ptr, count, dtype, factor):
    """``dst[i] *= factor`` for ``count`` elements at ``ptr``."""
    dt = _dtype_arg(dtype)
    n = _count_arg(count, "count")
    p = _ptr_arg(ptr, "ptr", n)
    f = _factor_arg(factor)
    _scale_check(dt, "dtype")
    if n:
        v = view_numpy(p, n, dt)
        v[...] = _scaled(v, dt, f)


def copy_ptr(dst_ptr, src_ptr, nbytes):
    """Copy ``nbytes`` from ``src_ptr`` to ``dst_ptr`` (memmove semantics)."""
    n = _count_arg(nbytes, "nbytes")
    d = _ptr_arg(dst_ptr, "dst_ptr", n)
    s = _ptr_arg(src_ptr, "src_ptr", n)
    if n and d != s:
        src = view_numpy(s, n, D.UINT8).copy()
        view_numpy(d, n, D.UINT8)[...] = src


def op_valid(dtype, op):
    """Whether the kernels implement ``op`` (SUM..BXOR) on ``dtype``."""
    return D.op_valid(operator.index(dtype), operator.index(op))


def chunk_elems(dtype):
    """Elements of ``dtype`` in one ``CHUNK_BYTES`` chunk."""
    return CHUNK_BYTES // D.ITEMSIZE[_dtype_arg(dtype)]


def kernel_isa():
    """'numpy': this module runs on NumPy, not on the C kernels."""
    return "numpy"


def _u8(v):
    """The bytes of the array view ``v``, flat (an empty one for no elements)."""
    return v.view(np.uint8) if v.size else np.empty(0, np.uint8)


def _collect(buffers, name, writable):
    if isinstance(buffers, (str, bytes)) or not hasattr(buffers, "__len__"):
        raise TypeError(f"{name} must be a sequence of arrays/tensors, got {type(buffers).__name__}")
    return [_u8(_view(b, f"{name}[{i}]", writable)[0]) for i, b in enumerate(buffers)]


def _packed(views, flat, name, writable, whose):
    """``flat``'s bytes (it must hold exactly the ``views``' total, ``whose`` total) and,
    for each view, the slice of them it packs into."""
    total = sum(v.nbytes for v in views)
    f, _ = _view(flat, name, writable)
    if f.nbytes != total:
        raise ValueError(f"{name} must hold exactly {total} bytes ({whose} total), got {f.nbytes}")
    spans, off = [], 0
    for v in views:
        spans.append(slice(off, off + v.nbytes))
        off += v.nbytes
    return _u8(f), spans


def flatten(buffers, out=None):
    """The bytes of every array/tensor in ``buffers``, back to back. See ``_core.flatten``."""
    views = _collect(buffers, "buffers", False)
    if out is None:
        out = np.empty(sum(v.nbytes for v in views), np.uint8)
    elif not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    flat, spans = _packed(views, out, "out", True, "the inputs'")
    for v, s in zip(views, spans):
        flat[s] = v
    return out


def unflatten(flat, buffers):
    """Copy the bytes of ``flat`` back into ``buffers``. See ``_core.unflatten``."""
    views = _collect(buffers, "buffers", True)
    fb, spans = _packed(views, flat, "flat", False, "the buffers'")
    for v, s in zip(views, spans):
        v[...] = fb[s]
    return buffers
