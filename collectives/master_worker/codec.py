"""Plain-data codec for master-worker commands and replies.

A command is an opcode and plain data: None, bool, int (64-bit), float, complex, str,
bytes, tuple/list, dict with str keys, slice, Ellipsis, a handle reference (an id on the
receiving node), NumPy arrays (dtype name, shape, bytes), a tensor by value (an array, its
dtype name and requires_grad) and a named constant (``Const('dtype:float32')``,
``Const('device:cuda:0')``...: the receiver maps the name through its own table).
Decoding builds only those types: nothing from the wire names code to run (no pickle, no
marshal).
"""
import operator
import struct

import numpy as np

_I = struct.Struct("<q")
_D = struct.Struct("<d")
_DD = struct.Struct("<dd")
_U = struct.Struct("<I")

# one-byte tags
_NONE, _TRUE, _FALSE, _INT, _FLOAT, _COMPLEX, _STR, _BYTES = b"NTFidcsb"
_TUPLE, _LIST, _DICT, _SLICE, _ELLIPSIS, _HANDLE, _ARRAY = b"()}:ehA"
_CONST, _TENSOR = b"KV"
_ARRAY_DTYPES = frozenset(("bool", "uint8", "int8", "int16", "int32", "int64", "uint16",
                           "uint32", "uint64", "float16", "float32", "float64", "complex64",
                           "complex128"))
MAX_DEPTH = 32


class _Token:
    """A value of one field (``_key`` reads it): equal to another of its class holding an
    equal value, hashable, shown as ``Class(value)``."""

    __slots__ = ()

    def __eq__(self, other):
        return isinstance(other, type(self)) and self._key(other) == self._key(self)

    def __hash__(self):
        return hash((type(self).__name__, self._key(self)))

    def __repr__(self):
        return f"{type(self).__name__}({self._key(self)!r})"


class Ref(_Token):
    """A reference to handle ``hid`` on the node a message goes to."""

    __slots__ = ("hid",)
    _key = operator.attrgetter("hid")

    def __init__(self, hid):
        self.hid = hid


class Const(_Token):
    """A named constant of the array library (a dtype, device, layout or memory format),
    as ``'<kind>:<name>'``; the receiver looks the name up in a fixed table."""

    __slots__ = ("name",)
    _key = operator.attrgetter("name")

    def __init__(self, name):
        self.name = name


class TensorValue:
    """A local tensor sent by value: a NumPy array (bfloat16 travels as its uint16 bits),
    the tensor's dtype name and whether it requires grad."""

    __slots__ = ("array", "dtype", "requires_grad")

    def __init__(self, array, dtype, requires_grad=False):
        self.array, self.dtype, self.requires_grad = array, dtype, requires_grad

    def __repr__(self):
        return f"TensorValue({self.dtype}, shape={self.array.shape})"


class Encoded(bytes):
    """A value encoded once, sent many times (a function's name on the call path)."""

    __slots__ = ()


def encoded(value):
    """``value``'s encoding, kept: encoding an Encoded appends these bytes as they are."""
    return Encoded(encode(value))


class CodecError(ValueError):
    """A value that is not plain data, or a malformed message."""


def encode(value, out=None):
    """Append the encoding of ``value`` to ``out`` (a bytearray, created if None)."""
    if out is None:
        out = bytearray()
    _enc(value, out, 0)
    return out


def _enc(v, out, depth):
    f = _ENCODERS.get(type(v))
    if f is not None:
        f(v, out, depth)
    else:
        _enc_other(v, out, depth)


def _enc_none(v, out, depth):
    out.append(_NONE)


def _enc_bool(v, out, depth):
    out.append(_TRUE if v else _FALSE)


def _enc_int(v, out, depth):
    v = int(v)
    if not -2**63 <= v < 2**63:
        raise CodecError(f"integer {v} does not fit 64 bits")
    out.append(_INT)
    out += _I.pack(v)


def _enc_float(v, out, depth):
    out.append(_FLOAT)
    out += _D.pack(float(v))


def _enc_complex(v, out, depth):
    out.append(_COMPLEX)
    out += _DD.pack(v.real, v.imag)


def _enc_str(v, out, depth):
    b = v.encode()
    out.append(_STR)
    out += _U.pack(len(b))
    out += b


def _enc_bytes(v, out, depth):
    b = bytes(v)
    out.append(_BYTES)
    out += _U.pack(len(b))
    out += b


def _enc_seq(v, out, depth):
    if depth >= MAX_DEPTH:
        raise CodecError("value nested too deeply to send")
    out.append(_TUPLE if type(v) is tuple else _LIST)
    out += _U.pack(len(v))
    for x in v:
        _enc(x, out, depth + 1)


def _enc_dict(v, out, depth):
    if depth >= MAX_DEPTH:
        raise CodecError("value nested too deeply to send")
    out.append(_DICT)
    out += _U.pack(len(v))
    for k, x in v.items():
        if type(k) is not str:
            raise CodecError(f"dict keys must be str to send, got {type(k).__name__}")
        _enc_str(k, out, depth)
        _enc(x, out, depth + 1)


def _enc_slice(v, out, depth):
    out.append(_SLICE)
    for x in (v.start, v.stop, v.step):
        _enc(x, out, depth + 1)


def _enc_ellipsis(v, out, depth):
    out.append(_ELLIPSIS)


def _enc_ref(v, out, depth):
    out.append(_HANDLE)
    out += _I.pack(v.hid)


def _enc_const(v, out, depth):
    out.append(_CONST)
    _enc_str(v.name, out, depth)


def _enc_tensor(v, out, depth):
    out.append(_TENSOR)
    _enc_array(v.array, out, depth)
    _enc_str(v.dtype, out, depth)
    _enc_bool(v.requires_grad, out, depth)


def _enc_encoded(v, out, depth):
    out += v


def _enc_array(v, out, depth):
    name = v.dtype.name
    if name not in _ARRAY_DTYPES:
        raise CodecError(f"arrays of dtype {name} cannot be sent")
    a = np.asarray(v, order="C")
    out.append(_ARRAY)
    _enc_str(name, out, depth)
    _enc_seq(tuple(a.shape), out, depth)
    out += _U.pack(a.nbytes)
    out += a.tobytes()


_ENCODERS = {type(None): _enc_none, bool: _enc_bool, np.bool_: _enc_bool, int: _enc_int,
             float: _enc_float, complex: _enc_complex, str: _enc_str, bytes: _enc_bytes,
             bytearray: _enc_bytes, tuple: _enc_seq, list: _enc_seq, dict: _enc_dict,
             slice: _enc_slice, type(Ellipsis): _enc_ellipsis, Ref: _enc_ref,
             np.ndarray: _enc_array, Const: _enc_const, TensorValue: _enc_tensor,
             Encoded: _enc_encoded}


def _enc_other(v, out, depth):
    if isinstance(v, np.ndarray):
        _enc_array(v, out, depth)
    elif isinstance(v, np.integer) or (isinstance(v, int) and not isinstance(v, bool)):
        _enc_int(v, out, depth)
    elif isinstance(v, bool):
        _enc_bool(v, out, depth)
    elif isinstance(v, (float, np.floating)):
        _enc_float(v, out, depth)
    elif isinstance(v, (complex, np.complexfloating)):
        _enc_complex(v, out, depth)
    elif isinstance(v, memoryview):
        _enc_bytes(v, out, depth)
    else:
        raise CodecError(f"a {type(v).__name__} is not plain data (send None, numbers, str, "
                         "bytes, tuples, lists, dicts, slices, arrays or remote tensors)")


def decode(buf, pos=0):
    """``(value, next_pos)`` decoded from ``buf`` (bytes-like) at ``pos``."""
    try:
        return _dec(memoryview(buf), pos, 0)
    except (IndexError, struct.error, UnicodeDecodeError, TypeError) as e:
        raise CodecError(f"malformed message: {e}") from None


def _dec(m, p, depth):
    if depth > MAX_DEPTH:
        raise CodecError("message nested too deeply")
    tag = m[p]
    p += 1
    if tag == _NONE:
        return None, p
    if tag == _TRUE:
        return True, p
    if tag == _FALSE:
        return False, p
    if tag == _INT:
        return _I.unpack_from(m, p)[0], p + 8
    if tag == _FLOAT:
        return _D.unpack_from(m, p)[0], p + 8
    if tag == _COMPLEX:
        re, im = _DD.unpack_from(m, p)
        return complex(re, im), p + 16
    if tag in (_STR, _BYTES):
        n = _U.unpack_from(m, p)[0]
        p += 4
        if p + n > len(m):
            raise CodecError("truncated message")
        b = bytes(m[p:p + n])
        return (b.decode() if tag == _STR else b), p + n
    if tag in (_TUPLE, _LIST):
        n = _U.unpack_from(m, p)[0]
        p += 4
        items = []
        for _ in range(n):
            x, p = _dec(m, p, depth + 1)
            items.append(x)
        return (tuple(items) if tag == _TUPLE else items), p
    if tag == _DICT:
        n = _U.unpack_from(m, p)[0]
        p += 4
        d = {}
        for _ in range(n):
            k, p = _dec(m, p, depth + 1)
            d[k], p = _dec(m, p, depth + 1)
        return d, p
    if tag == _SLICE:
        a, p = _dec(m, p, depth + 1)
        b, p = _dec(m, p, depth + 1)
        c, p = _dec(m, p, depth + 1)
        return slice(a, b, c), p
    if tag == _ELLIPSIS:
        return Ellipsis, p
    if tag == _HANDLE:
        return Ref(_I.unpack_from(m, p)[0]), p + 8
    if tag == _ARRAY:
        name, p = _dec(m, p, depth + 1)
        shape, p = _dec(m, p, depth + 1)
        if name not in _ARRAY_DTYPES or type(shape) is not tuple:
            raise CodecError("malformed array in message")
        n = _U.unpack_from(m, p)[0]
        p += 4
        if p + n > len(m):
            raise CodecError("truncated message")
        a = np.frombuffer(bytes(m[p:p + n]), dtype=name).reshape(shape).copy()
        return a, p + n
    if tag == _CONST:
        name, p = _dec(m, p, depth + 1)
        if type(name) is not str:
            raise CodecError("malformed constant in message")
        return Const(name), p
    if tag == _TENSOR:
        a, p = _dec(m, p, depth + 1)
        dt, p = _dec(m, p, depth + 1)
        rg, p = _dec(m, p, depth + 1)
        if type(a) is not np.ndarray or type(dt) is not str or type(rg) is not bool:
            raise CodecError("malformed tensor in message")
        return TensorValue(a, dt, rg), p
    raise CodecError(f"unknown tag {tag!r} in message")


# ---- frames: [u32 length][u16 opcode][encoded args tuple] ---------------------------------
_FRAME = struct.Struct("<IH")
FRAME_HEADER = _FRAME.size


def frame(opcode, args):
    """The bytes of one command (or reply) frame."""
    out = bytearray(FRAME_HEADER)
    _enc(args, out, 0)
    _FRAME.pack_into(out, 0, len(out), opcode)
    return out


def unframe(buf):
    """``(opcode, args)`` of a frame held at the start of ``buf``."""
    length, opcode = _FRAME.unpack_from(buf, 0)
    if length < FRAME_HEADER + 1 or length > len(buf):
        raise CodecError(f"malformed frame (length {length}, buffer {len(buf)})")
    args, end = decode(memoryview(buf)[:length], FRAME_HEADER)
    if end != length:
        raise CodecError("trailing bytes in frame")
    return opcode, args
