"""The TCPStore wire format, shared by the client and the server."""
import struct

# ---- TCPStore: wire format --------------------------------------------------------------
#
# A frame is a u32 length then the body. Request body: u8 version, u8 op, u32 nargs,
# then nargs times (u32 length, bytes). Reply body: u8 status, u32 nargs, args.
# Numbers travel as ASCII decimal. No pickle: values are opaque bytes.

PROTOCOL_VERSION = 1
SERVER_LINGER = 30.0  # seconds a closed master keeps serving clients still connected
MAX_FRAME = 1 << 28
_HDR = struct.Struct("!I")
_REQ = struct.Struct("!BBI")
_REP = struct.Struct("!BI")

OP_SET, OP_GET, OP_ADD, OP_CAS, OP_WAIT, OP_CHECK, OP_DELETE, OP_NUM_KEYS, OP_APPEND, \
    OP_MULTI_GET, OP_MULTI_SET, OP_LIST_KEYS, OP_PING, OP_QUEUE_PUSH, OP_QUEUE_POP, \
    OP_QUEUE_LEN, OP_LEASE = range(1, 18)
ST_OK, ST_TIMEOUT, ST_ERROR, ST_REJECTED = range(4)


def _encode_args(args):
    parts = []
    for a in args:
        parts.append(_HDR.pack(len(a)))
        parts.append(a)
    return parts


def encode_request(op, args):
    body = [_REQ.pack(PROTOCOL_VERSION, op, len(args))] + _encode_args(args)
    n = sum(len(p) for p in body)
    return _HDR.pack(n) + b"".join(body)


def _encode_reply(status, args):
    body = [_REP.pack(status, len(args))] + _encode_args(args)
    n = sum(len(p) for p in body)
    return _HDR.pack(n) + b"".join(body)


def _decode_args(body, pos, nargs):
    args = []
    for _ in range(nargs):
        if pos + 4 > len(body):
            raise ValueError("argument header past the end of the frame")
        n, = _HDR.unpack_from(body, pos)
        pos += 4
        if pos + n > len(body):
            raise ValueError("argument past the end of the frame")
        args.append(body[pos:pos + n])
        pos += n
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} stray bytes after the arguments")
    return args


def _decode_request(body):
    if len(body) < _REQ.size:
        raise ValueError("frame shorter than its header")
    version, op, nargs = _REQ.unpack_from(body)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    if nargs > len(body):
        raise ValueError(f"{nargs} arguments cannot fit in {len(body)} bytes")
    return op, _decode_args(body, _REQ.size, nargs)
