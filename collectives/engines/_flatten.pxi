# Bucketing: flatten many small tensors into one uint8 message and copy them back.
# Included from _core.pyx.

cdef object _collect(object buffers, str name, bint writable, cbuf **out_bufs, Py_ssize_t *out_total):
    """Validate ``buffers``; return the list that keeps them alive, fill a malloc'ed cbuf array."""
    if isinstance(buffers, (str, bytes)) or not hasattr(buffers, "__len__"):
        raise TypeError(f"{name} must be a sequence of arrays/tensors, got {type(buffers).__name__}")
    items = list(buffers)
    cdef Py_ssize_t i, n = len(items), total = 0
    cdef cbuf *bufs = <cbuf *>malloc((n if n > 0 else 1) * sizeof(cbuf))
    if bufs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            _get_buf(items[i], f"{name}[{i}]", writable, &bufs[i])
            bufs[i].count *= <Py_ssize_t>coll_itemsize(bufs[i].dtype)  # now bytes
            total += bufs[i].count
    except BaseException:
        free(bufs)
        raise
    out_bufs[0] = bufs
    out_total[0] = total
    return items


def flatten(buffers, out=None):
    """The bytes of every array/tensor in ``buffers``, back to back, in one uint8 array.

    Inputs may mix dtypes and mix NumPy arrays with torch CPU tensors; each must be
    contiguous. Copies run with the GIL released.

    Args:
        buffers: sequence of arrays/tensors.
        out: optional C-contiguous, writeable NumPy array of exactly the total byte
            size to reuse (e.g. a bucket kept across steps).

    Returns:
        ``out`` or a new ``numpy.uint8`` array of ``sum(b.nbytes)`` bytes.

    Example:
        >>> flat = flatten([np.ones(2, np.float32), np.arange(3, dtype=np.int8)])
        >>> flat.nbytes
        11
    """
    cdef cbuf *bufs = NULL
    cdef cbuf o
    cdef Py_ssize_t total, i, n, off = 0
    cdef char *dst
    items = _collect(buffers, "buffers", False, &bufs, &total)
    n = len(items)
    try:
        if out is None:
            out = np.empty(total, np.uint8)
        elif not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
        _get_buf(out, "out", True, &o)
        if o.count * <Py_ssize_t>coll_itemsize(o.dtype) != total:
            raise ValueError(f"out must hold exactly {total} bytes (the inputs' total), "
                             f"got {o.count * <Py_ssize_t>coll_itemsize(o.dtype)}")
        dst = o.ptr
        with nogil:
            for i in range(n):
                if bufs[i].count:
                    memcpy(dst + off, bufs[i].ptr, bufs[i].count)
                off += bufs[i].count
    finally:
        free(bufs)
    return out


def unflatten(flat, buffers):
    """Copy the bytes of ``flat`` back into ``buffers`` (the inverse of :func:`flatten`).

    Args:
        flat: contiguous array/tensor holding exactly the total bytes of ``buffers``.
        buffers: sequence of contiguous, writeable arrays/tensors, in flatten's order.

    Returns:
        ``buffers``.

    Raises:
        ValueError: ``flat`` has a different size in bytes, or an input is non-contiguous.
    """
    cdef cbuf *bufs = NULL
    cdef cbuf f
    cdef Py_ssize_t total, i, n, off = 0
    cdef char *src
    items = _collect(buffers, "buffers", True, &bufs, &total)
    n = len(items)
    try:
        _get_buf(flat, "flat", False, &f)
        if f.count * <Py_ssize_t>coll_itemsize(f.dtype) != total:
            raise ValueError(f"flat must hold exactly {total} bytes (the buffers' total), "
                             f"got {f.count * <Py_ssize_t>coll_itemsize(f.dtype)}")
        src = f.ptr
        with nogil:
            for i in range(n):
                if bufs[i].count:
                    memcpy(bufs[i].ptr, src + off, bufs[i].count)
                off += bufs[i].count
    finally:
        free(bufs)
    return buffers
