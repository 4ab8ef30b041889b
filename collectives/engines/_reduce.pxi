# Elementwise reductions: reduce_into, reduce_many, scale and their pointer-level forms.
# Included from _core.pyx.

cdef struct cbuf:
    char *ptr
    Py_ssize_t count
    int dtype


cdef int _np_dtype_code(cnp.ndarray arr):
    """Our dtype code of a native-byte-order NumPy array, -1 if none (left to to_buffer)."""
    if not cnp.PyArray_ISNOTSWAPPED(arr):
        return -1
    cdef int t = cnp.PyArray_TYPE(arr)
    cdef Py_ssize_t size = cnp.PyArray_ITEMSIZE(arr)
    if t == cnp.NPY_FLOAT:
        return COLL_FLOAT32
    if t == cnp.NPY_DOUBLE:
        return COLL_FLOAT64
    if t == NPY_HALF:
        return COLL_FLOAT16
    if t == cnp.NPY_CFLOAT:
        return COLL_COMPLEX64
    if t == cnp.NPY_CDOUBLE:
        return COLL_COMPLEX128
    if t == cnp.NPY_BOOL:
        return COLL_BOOL
    if t == cnp.NPY_BYTE:
        return COLL_INT8
    if t == cnp.NPY_UBYTE:
        return COLL_UINT8
    if t == cnp.NPY_SHORT:
        return COLL_INT16
    if t == cnp.NPY_INT or t == cnp.NPY_LONG or t == cnp.NPY_LONGLONG:
        if size == 4:
            return COLL_INT32
        if size == 8:
            return COLL_INT64
    return -1


cdef object _torch = None          # the torch module, once a tensor has been seen
cdef object _torch_tensor = None
cdef object _torch_strided = None
cdef dict _torch_codes = None


cdef int _torch_buf(object obj, str name, cbuf *out) except -1:
    """Fast path for a torch tensor: 0 if filled, 1 to fall back to to_buffer (which raises)."""
    global _torch, _torch_tensor, _torch_strided, _torch_codes
    if _torch is None:
        import sys
        mod = sys.modules.get("torch")
        if mod is None or getattr(mod, "Tensor", None) is None or getattr(mod, "strided", None) is None:
            return 1  # torch absent, or half-imported by another thread: obj is no tensor
        _torch, _torch_tensor, _torch_strided = mod, mod.Tensor, mod.strided
        _torch_codes = {
            mod.float16: COLL_FLOAT16, mod.bfloat16: COLL_BFLOAT16, mod.float32: COLL_FLOAT32,
            mod.float64: COLL_FLOAT64, mod.complex64: COLL_COMPLEX64, mod.complex128: COLL_COMPLEX128,
            mod.int8: COLL_INT8, mod.uint8: COLL_UINT8, mod.int16: COLL_INT16, mod.int32: COLL_INT32,
            mod.int64: COLL_INT64, mod.bool: COLL_BOOL}
    if not isinstance(obj, _torch_tensor):
        return 1
    code = _torch_codes.get(obj.dtype)
    if code is None or obj.layout is not _torch_strided or not obj.is_cpu or not obj.is_contiguous():
        return 1  # to_buffer raises the right error (or accepts it, e.g. CUDA, handled after)
    if (code == COLL_COMPLEX64 or code == COLL_COMPLEX128) and (obj.is_conj() or obj.is_neg()):
        raise ValueError(f"{name} is a lazily conjugated/negated view; call .resolve_conj() "
                         f"(and .resolve_neg()) first")
    out.ptr = <char *><uintptr_t>obj.data_ptr()
    out.count = obj.numel()
    out.dtype = code
    return 0


cdef int _get_buf(object obj, str name, bint writable, cbuf *out) except -1:
    """Fill ``out`` from an ndarray, a torch CPU tensor or a Buffer; raise naming ``name``."""
    cdef cnp.ndarray arr
    cdef int code
    if isinstance(obj, cnp.ndarray):
        arr = <cnp.ndarray>obj
        code = _np_dtype_code(arr)
        if code >= 0:
            if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
                raise ValueError(f"{name} must be contiguous (C order); call numpy.ascontiguousarray first")
            if writable and not cnp.PyArray_ISWRITEABLE(arr):
                raise ValueError(f"{name} must be writeable")
            out.ptr = <char *>cnp.PyArray_DATA(arr)
            out.count = cnp.PyArray_SIZE(arr)
            out.dtype = code
            return 0
    elif _torch_buf(obj, name, out) == 0:
        return 0
    if not isinstance(obj, Buffer):
        obj = to_buffer(obj, name)  # TypeError/ValueError naming ``name``
    if obj.device != -1:
        raise ValueError(f"{name} must be in host (CPU) memory, got CUDA device {obj.device}")
    if obj.dtype < 0 or obj.dtype >= COLL_NUM_DTYPES:
        raise TypeError(f"{name} has unknown dtype code {obj.dtype}")
    out.ptr = <char *><uintptr_t>obj.ptr
    out.count = obj.count
    out.dtype = obj.dtype
    return 0


cdef int _op_code(object op) except -1:
    """The int code of ``op`` (int, ReduceOp or anything with __index__/__int__)."""
    cdef long code
    if type(op) is int:
        code = op
    elif isinstance(op, (bool, float, complex, str)):
        raise TypeError(f"op must be a reduction op (collectives.core.dtypes code or ReduceOp), "
                        f"got {type(op).__name__} {op!r}")
    else:
        try:
            code = operator.index(op)
        except TypeError:
            if not hasattr(type(op), "__int__"):
                raise TypeError(f"op must be a reduction op (collectives.core.dtypes code or ReduceOp), "
                                f"got {type(op).__name__}") from None
            code = int(op)
    if code == COLL_AVG or code == COLL_PREMUL_SUM:
        raise ValueError(f"op {_D.OP_NAMES[code]} is not an elementwise reduction; reduce with SUM, "
                         f"then scale(dst, factor)")
    if code < 0 or code > COLL_BXOR:
        raise ValueError(f"op must be one of SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR "
                         f"(codes 0, 2-7), got {code}")
    return <int>code


cdef int _dtype_arg(object dtype) except -1:
    cdef int code
    try:
        code = operator.index(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a collectives.core.dtypes code (int), "
                        f"got {type(dtype).__name__}") from None
    if coll_itemsize(code) == 0:
        raise ValueError(f"dtype must be a collectives.core.dtypes code 0-{COLL_BOOL}, got {code}")
    return code


cdef int _check_op(int dtype, int op) except -1:
    if coll_op_valid(dtype, op):
        return 0
    if op == COLL_MIN or op == COLL_MAX:
        why = "complex numbers are unordered"
    else:
        why = "bitwise ops need an integer or bool dtype"
    raise ValueError(f"op {_D.OP_NAMES[op]} is not defined for dtype {_D.DTYPE_NAMES[dtype]} ({why})")


cdef int _check_same(cbuf *dst, cbuf *src, str name) except -1:
    if src.dtype != dst.dtype:
        raise TypeError(f"{name} has dtype {_D.DTYPE_NAMES[src.dtype]}, dst has "
                        f"{_D.DTYPE_NAMES[dst.dtype]}; they must match")
    if src.count != dst.count:
        raise ValueError(f"{name} has {src.count} elements, dst has {dst.count}; they must match")
    return 0


cdef bint _partial_overlap(char *a, char *b, Py_ssize_t nbytes):
    return a != b and a < b + nbytes and b < a + nbytes


cdef int _chk(int rc) except -1:
    if rc == COLL_OK:
        return 0
    if rc == COLL_EDTYPE:
        raise ValueError("unknown dtype code")
    raise ValueError("op not defined for this dtype")


cdef Py_ssize_t _count_arg(object count, str name) except -1:
    cdef Py_ssize_t n = operator.index(count)
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


cdef uintptr_t _ptr_arg(object ptr, str name, Py_ssize_t nbytes) except? 0:
    cdef uintptr_t p
    try:
        p = operator.index(ptr)
    except TypeError:
        raise TypeError(f"{name} must be an int address, got {type(ptr).__name__}") from None
    if p == 0 and nbytes > 0:
        raise ValueError(f"{name} is a null pointer")
    return p


def reduce_into(dst, src, op):
    """``dst = op(dst, src)`` elementwise, in place, with the GIL released.

    Args:
        dst: contiguous, writeable NumPy array or torch CPU tensor.
        src: contiguous array/tensor of the same dtype and element count (shape may differ).
        op: SUM, PRODUCT, MIN, MAX, BAND, BOR or BXOR (code from collectives.core.dtypes or a
            ReduceOp). AVG/PREMUL_SUM: reduce with SUM, then :func:`scale`.

    Returns:
        ``dst``.

    Raises:
        TypeError: unsupported or mismatched dtypes, an op that is not int-like.
        ValueError: mismatched lengths, non-contiguous input, an op the dtype lacks
            (BAND on float, MAX on complex), partially overlapping buffers.

    Example:
        >>> a = np.ones(4, np.float32); reduce_into(a, np.full(4, 2, np.float32), dtypes.SUM)
        array([3., 3., 3., 3.], dtype=float32)
    """
    cdef int code = _op_code(op)
    cdef cbuf d, s
    cdef int rc
    _get_buf(dst, "dst", True, &d)
    _get_buf(src, "src", False, &s)
    _check_same(&d, &s, "src")
    _check_op(d.dtype, code)
    if _partial_overlap(d.ptr, s.ptr, d.count * <Py_ssize_t>coll_itemsize(d.dtype)):
        raise ValueError("src partially overlaps dst; pass the same buffer or disjoint ones")
    with nogil:
        rc = coll_reduce(d.ptr, s.ptr, d.count, d.dtype, code)
    _chk(rc)
    return dst


def reduce_many(dst, srcs, op):
    """``dst = op(srcs[0], srcs[1], ...)`` elementwise, in one pass, GIL released.

    Works chunk by chunk (``CHUNK_BYTES``) so the partial result stays in cache; the
    result equals applying :func:`reduce_into` with each source in order, rounding
    half types after every step. ``dst`` may be any of the sources itself (then that
    chunk is folded in a buffer on the stack first); it must not partially overlap one.

    Raises:
        TypeError/ValueError as :func:`reduce_into`, naming ``srcs[i]``; ValueError for
        an empty ``srcs``.
    """
    cdef int code = _op_code(op)
    cdef cbuf d, s
    cdef Py_ssize_t i, n, nbytes
    cdef int rc
    cdef const void **ptrs
    if isinstance(srcs, (str, bytes)) or not hasattr(srcs, "__len__"):
        raise TypeError(f"srcs must be a sequence of arrays/tensors, got {type(srcs).__name__}")
    srcs = list(srcs)
    n = len(srcs)
    if n < 1:
        raise ValueError("srcs must hold at least one array/tensor")
    if n > 0x7FFFFFFF:
        raise ValueError("srcs has too many entries")
    _get_buf(dst, "dst", True, &d)
    _check_op(d.dtype, code)
    nbytes = d.count * <Py_ssize_t>coll_itemsize(d.dtype)
    ptrs = <const void **>malloc(n * sizeof(void *))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            name = f"srcs[{i}]"
            _get_buf(srcs[i], name, False, &s)
            _check_same(&d, &s, name)
            if _partial_overlap(d.ptr, s.ptr, nbytes):
                raise ValueError(f"{name} partially overlaps dst; a source may be dst itself, "
                                 f"nothing in between")
            ptrs[i] = s.ptr
        with nogil:
            rc = coll_reduce_many(d.ptr, ptrs, <int>n, d.count, d.dtype, code)
    finally:
        free(ptrs)
    _chk(rc)
    return dst


cdef int _scale_check(int dtype, str name) except -1:
    if dtype < 0 or dtype > COLL_COMPLEX128:  # codes 0-5: floating and complex
        raise ValueError(f"{name} must have a floating or complex dtype to scale, got "
                         f"{_D.DTYPE_NAMES[dtype]}")
    return 0


cdef double _factor_arg(object factor) except? -1.0:
    if isinstance(factor, (bool, complex)) or not isinstance(factor, (int, float, np.number)):
        raise TypeError(f"factor must be a real number, got {type(factor).__name__}")
    if isinstance(factor, np.complexfloating):
        raise TypeError("factor must be a real number, got a complex one")
    return float(factor)


def scale(dst, factor):
    """``dst *= factor`` in place (AVG, PREMUL_SUM), GIL released.

    The factor is rounded to the compute type first (float32 for float16, bfloat16,
    float32, complex64; float64 otherwise), as ``tensor.mul_(factor)`` does in torch;
    complex values are multiplied by ``factor + 0j``.

    Raises:
        ValueError: an integer or bool ``dst``; TypeError: a non-real factor.
    """
    cdef cbuf d
    cdef double f = _factor_arg(factor)
    cdef int rc
    _get_buf(dst, "dst", True, &d)
    _scale_check(d.dtype, "dst")
    with nogil:
        rc = coll_scale(d.ptr, d.count, d.dtype, f)
    _chk(rc)
    return dst


def reduce_buffers(dst, src, op):
    """``reduce_into`` on two :class:`collectives.core.tensors.Buffer` objects (host memory)."""
    if not isinstance(dst, Buffer):
        raise TypeError(f"dst must be a collectives.core.tensors.Buffer, got {type(dst).__name__}")
    if not isinstance(src, Buffer):
        raise TypeError(f"src must be a collectives.core.tensors.Buffer, got {type(src).__name__}")
    reduce_into(dst, src, op)
    return dst


def reduce_ptr(dst_ptr, src_ptr, count, dtype, op):
    """``dst[i] = op(dst[i], src[i])`` for ``count`` elements at two addresses (ints).

    For backends written in Python (the mpi backend's user-defined MPI op). The
    caller guarantees the memory; only the arguments are checked.
    """
    cdef int dt = _dtype_arg(dtype)
    cdef int code = _op_code(op)
    cdef Py_ssize_t n = _count_arg(count, "count")
    cdef uintptr_t d = _ptr_arg(dst_ptr, "dst_ptr", n)
    cdef uintptr_t s = _ptr_arg(src_ptr, "src_ptr", n)
    cdef int rc
    _check_op(dt, code)
    with nogil:
        rc = coll_reduce(<void *>d, <const void *>s, n, dt, code)
    _chk(rc)


def reduce_many_ptr(dst_ptr, src_ptrs, count, dtype, op):
    """``dst = op(src_0, ..., src_k)`` for ``count`` elements; addresses are ints."""
    cdef int dt = _dtype_arg(dtype)
    cdef int code = _op_code(op)
    cdef Py_ssize_t n = _count_arg(count, "count")
    cdef uintptr_t d = _ptr_arg(dst_ptr, "dst_ptr", n)
    cdef Py_ssize_t i, k
    cdef int rc
    cdef const void **ptrs
    _check_op(dt, code)
    src_ptrs = list(src_ptrs)
    k = len(src_ptrs)
    if k < 1:
        raise ValueError("src_ptrs must hold at least one address")
    ptrs = <const void **>malloc(k * sizeof(void *))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for i in range(k):
            ptrs[i] = <const void *>_ptr_arg(src_ptrs[i], f"src_ptrs[{i}]", n)
        with nogil:
            rc = coll_reduce_many(<void *>d, ptrs, <int>k, n, dt, code)
    finally:
        free(ptrs)
    _chk(rc)


def scale_ptr(ptr, count, dtype, factor):
    """``dst[i] *= factor`` for ``count`` elements of a floating/complex dtype at ``ptr``."""
    cdef int dt = _dtype_arg(dtype)
    cdef Py_ssize_t n = _count_arg(count, "count")
    cdef uintptr_t p = _ptr_arg(ptr, "ptr", n)
    cdef double f = _factor_arg(factor)
    cdef int rc
    _scale_check(dt, "dtype")
    with nogil:
        rc = coll_scale(<void *>p, n, dt, f)
    _chk(rc)


def copy_ptr(dst_ptr, src_ptr, nbytes):
    """Copy ``nbytes`` from ``src_ptr`` to ``dst_ptr`` (memmove semantics), GIL released."""
    cdef Py_ssize_t n = _count_arg(nbytes, "nbytes")
    cdef uintptr_t d = _ptr_arg(dst_ptr, "dst_ptr", n)
    cdef uintptr_t s = _ptr_arg(src_ptr, "src_ptr", n)
    with nogil:
        coll_copy(<void *>d, <const void *>s, n)


def op_valid(dtype, op):
    """Whether the kernels implement ``op`` (SUM..BXOR) on ``dtype``."""
    return bool(coll_op_valid(operator.index(dtype), operator.index(op)))


def chunk_elems(dtype):
    """Elements of ``dtype`` in one ``CHUNK_BYTES`` chunk."""
    return coll_chunk_elems(_dtype_arg(dtype))


def kernel_isa():
    """The instruction set the kernels run on: 'avx512bf16', 'avx512', 'avx2' or 'baseline'."""
    return coll_kernel_isa().decode()


def _force_isa(name):
    """Tests/benchmarks only: run every kernel on ``name``; False if this CPU lacks it."""
    cdef bytes b = name.encode()
    return coll_force_isa(b) == COLL_OK
