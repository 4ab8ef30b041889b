"""The worker side: a loop that executes the master's commands in issue order.

Every rank other than 0 enters :func:`serve` from ``init_master_worker`` and leaves the
process from there: on the master's shutdown command, on the master's death (its pid
gone on this host, or its connection closed), or on an interrupt.
"""
import os
import sys
import traceback

import numpy as np

from ..api import collective_ops as _coll
from ..api.group import destroy_process_group, new_group
from ..core.convert import buffer
from ..core.errors import DistError
from ..core.reduce_op import ReduceOp
import collectives.master_worker.protocol as P
from .codec import Const, Ref, TensorValue, encode, frame, unframe
from .ops import make_lib
from .registry import lookup

_DTYPE_CODES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128")
_REDUCE_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


class MasterGone(Exception):
    """The master ended without a shutdown command."""


def pid_alive(pid):
    """True if ``pid`` is a live process on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def wait_request(req, timeout, alive, what):
    """Wait for ``req`` in slices of POLL_S, calling ``alive()`` between slices (it raises
    when the peer is gone); DistBackendError after ``timeout`` seconds (None: no limit,
    only for the idle wait of a worker whose master is checked by ``alive``)."""
    waited = 0.0
    while True:
        step = P.POLL_S if timeout is None else min(P.POLL_S, max(timeout - waited, 0.001))
        try:
            req.wait(step)
            return
        except DistError:
            if req.test():
                raise  # the operation failed (a peer closed its connection...)
        waited += step
        alive()
        if timeout is not None and waited >= timeout:
            from ..core.errors import DistBackendError
            raise DistBackendError(f"{what}: no answer within {timeout:.1f}s")


#: the commands whose arguments are the handler method's, as they come
_HANDLERS = {P.C_PUT: "put", P.C_GET: "get", P.C_CALL: "call", P.C_CALLR: "call_reply",
             P.C_BIND: "bind", P.C_SENDTO: "send_to", P.C_RECVFROM: "recv_from",
             P.C_COLL: "collective", P.C_RPC: "rpc"}


class Worker:
    """One worker's state: its handle table, failures, pending sends and subgroups."""

    def __init__(self, pg, lib, master_pid, same_host, timeout):
        self.pg = pg
        self.backend = pg.backend
        self.lib = make_lib(lib)
        self.master_pid = master_pid
        self.same_host = same_host
        self.timeout = timeout
        self.objs = {}          # hid -> array/tensor (or a registered function's result)
        self.failed = {}        # hid -> message of the failure that made it
        self.errors = []        # (seq, command, message, [failed hids]) not yet reported
        self.sends = []         # (request, buffer kept alive) in flight
        self.groups = {}        # tuple of ranks -> ProcessGroup among workers
        self.pair = None        # the group {master, this worker}, for bulk copies
        self.seq = 0
        self.node = pg.rank() - 1
        self.table = self.lib.table()

    # ---- transport -----------------------------------------------------------------------
    def alive(self):
        if self.same_host and not pid_alive(self.master_pid):
            raise MasterGone(f"the master (pid {self.master_pid}) is gone")

    def isend(self, arr, dst, tag):
        req = self.backend.isend(buffer(arr), dst, tag)
        if not req.test():
            self.sends.append((req, arr))
        if len(self.sends) > 64:
            self.sends = [(r, a) for r, a in self.sends if not r.test()]

    def recv_into(self, arr, src, tag, what):
        req = self.backend.irecv(buffer(arr), src, tag)
        wait_request(req, self.timeout, self.alive if src == 0 else (lambda: None), what)

    def reply(self, payload, ok=True):
        errs, self.errors = self.errors, []
        msg = frame(P.R_OK if ok else P.R_FAIL, (payload, errs))
        if len(msg) > P.REPLY_MAX:
            self.isend(np.frombuffer(frame(P.R_BIG, (len(msg), [])), np.uint8), 0, P.T_REPLY)
            self.isend(np.frombuffer(msg, np.uint8), 0, P.T_REPLY_BIG)
        else:
            self.isend(np.frombuffer(msg, np.uint8), 0, P.T_REPLY)

    # ---- the loop ------------------------------------------------------------------------
    def serve(self):
        bufs = [np.empty(P.CMD_MAX, np.uint8), np.empty(P.CMD_MAX, np.uint8)]
        which = 0
        req = self.backend.irecv(buffer(bufs[0]), 0, P.T_CMD)
        while True:
            wait_request(req, None, self.alive, "waiting for the master's next command")
            cur = bufs[which]
            which ^= 1
            req = self.backend.irecv(buffer(bufs[which]), 0, P.T_CMD)  # the next one, early
            op, args = unframe(cur)
            if op == P.C_BIG:
                big = np.empty(args[0], np.uint8)
                self.recv_into(big, 0, P.T_BIG, "receiving a large command")
                op, args = unframe(big)
            self.seq += 1
            if op == P.C_SHUTDOWN:
                return
            self.execute(op, args)

    def execute(self, op, args):
        try:
            if op == P.C_SYNC:
                self.reply(args[0])
            elif op == P.C_FREE:
                for hid in args[0]:
                    self.objs.pop(hid, None)
                    self.failed.pop(hid, None)
            elif op == P.C_ALLOC:
                out, kind, shape, dtype, value, device = args
                self.run(out, "allocate " + kind, lambda: self.lib.alloc(kind, shape, dtype, value, device))
            elif op in _HANDLERS:
                getattr(self, _HANDLERS[op])(*args)
            elif op == P.C_META:
                self.meta(args[0])
            elif op == P.C_GRAD:
                self.lib.set_grad(args[0])
            elif op == P.C_PAIR:
                self.pair = new_group([0, self.pg.rank()], use_local_synchronization=True)
            elif op == P.C_SEED:
                self.lib.seed(args[0])
            elif op == P.C_STATS:
                self.reply({"live": len(self.objs), "failed": len(self.failed),
                            "rss": _rss_bytes(), "seq": self.seq})
            else:
                self.fail(f"command {op}", f"unknown command {op}", [])
        except (MasterGone, DistError):
            raise
        except Exception as e:  # a bug in this loop: report it, keep serving
            what = P.COMMAND_NAMES.get(op, str(op))
            self.fail(what, _describe(e), [])
            if op in (P.C_SYNC, P.C_META, P.C_STATS, P.C_GET, P.C_CALLR) or (
                    op == P.C_RPC and args[-1]):
                self.reply(f"{what} failed: {_describe(e)}", ok=False)  # the master waits

    # ---- bookkeeping -----------------------------------------------------------------------
    def fail(self, what, message, hids):
        for h in hids:
            self.objs.pop(h, None)
            self.failed[h] = f"{what} failed: {message}"
        self.errors.append((self.seq, what, message, list(hids)))

    def resolve(self, v):
        """Handle references in decoded arguments -> this worker's objects."""
        t = type(v)
        if t is Ref:
            obj = self.objs.get(v.hid)
            if obj is None:
                why = self.failed.get(v.hid)
                raise _InputFailed(why or f"remote tensor {v.hid} does not exist on this node "
                                   "(freed?)")
            return obj
        if t is tuple or t is list:
            return t(self.resolve(x) for x in v)
        if t is dict:
            return {k: self.resolve(x) for k, x in v.items()}
        if t is slice:
            return slice(self.resolve(v.start), self.resolve(v.stop), self.resolve(v.step))
        if t is Const:
            return self.lib.const(v)
        if t is TensorValue:
            return self.lib.value(v)
        return v

    def run(self, out, what, fn):
        try:
            obj = fn()
        except Exception as e:
            self.fail(what, _describe(e), [out] if out >= 0 else [])
            return
        if out >= 0:
            self.objs[out] = obj

    # ---- commands ----------------------------------------------------------------------------
    def put(self, out, shape, dtype, device, bulk=False):
        lib = self.lib
        host = lib.alloc("empty", shape, dtype, None, -1)
        if bulk:
            _coll.broadcast(host, src=0, group=self.pair)
        else:
            self.recv_into(host, 0, P.T_DATA, "receiving a tensor from the master")
        self.run(out, "send", lambda: host if device < 0 else lib.to_device(host, device))

    def get(self, hid, bulk, expect=None):
        """Reply with the meta, then the data: by a broadcast in the pair group when
        ``bulk`` (None: when large), else by p2p. Where it has no array to send, the data
        message is the ``expect`` (shape, dtype) the master's receive was posted for (empty
        if unknown), so a failure never desynchronises the stream."""
        filler = _EMPTY if expect is None else self.lib.alloc("zeros", tuple(expect[0]),
                                                               expect[1], None, -1)
        try:
            obj = self.resolve(Ref(hid))
            host = self.lib.host(obj) if self.lib.is_array(obj) else None
            if host is not None:
                buffer(host)  # a dtype the transport cannot carry fails here, before the reply
        except Exception as e:
            self.reply(_describe(e), ok=False)
            if not bulk:
                self.isend(filler, 0, P.T_DATA)  # the master posted a receive
            return
        if host is None:
            self.reply(("value", _plain(self.lib, obj)))
            if not bulk:
                self.isend(filler, 0, P.T_DATA)
            return
        nbytes = host.nbytes if isinstance(host, np.ndarray) else host.numel() * host.element_size()
        if expect is not None and (tuple(expect[0]), expect[1]) != self.lib.meta(obj)[:2]:
            self.reply(f"the tensor is {self.lib.meta(obj)[:2]}, the master expected "
                       f"{tuple(expect)} (changed in place?)", ok=False)
            self.isend(filler, 0, P.T_DATA)
            return
        if bulk is None:
            bulk = self.pair is not None and nbytes >= P.BULK_MIN
        self.reply(("array",) + self.lib.meta(obj) + (bool(bulk),))
        if bulk:  # the master joins once it has read the reply
            _coll.broadcast(host, src=self.pg.rank(), group=self.pair)
        else:
            self.isend(host, 0, P.T_DATA)

    def meta(self, hid):
        try:
            obj = self.resolve(Ref(hid))
        except Exception as e:
            self.reply(_describe(e), ok=False)
            return
        if self.lib.is_array(obj):
            self.reply(("array",) + self.lib.meta(obj))
        else:
            self.reply(("value", _plain(self.lib, obj)))

    def _run_call(self, name, args, kwargs):
        entry = self.table.get(name)
        if entry is None:  # the master refuses these before sending; a worker never guesses
            raise PermissionError(f"{name!r} is not in this worker's allow-list")
        a = self.resolve(args)
        r = entry.fn(*a, **self.resolve(kwargs)) if kwargs else entry.fn(*a)
        return self.lib.result(r)

    def call(self, name, out, args, kwargs=None):
        """A queued call: ``out`` is the handle id for a tensor result, a list of ids for a
        named tuple of tensors, or -1 (in place, or a result of None)."""
        try:
            r = self._run_call(name, args, kwargs)
            if type(out) is int:
                if out >= 0:
                    if not self.lib.is_array(r):
                        raise TypeError(f"returned a {type(r).__name__} where earlier calls "
                                        "with the same kinds of arguments returned a tensor")
                    self.objs[out] = r
            else:
                if not isinstance(r, tuple) or len(r) != len(out):
                    raise TypeError(f"returned a {type(r).__name__} where earlier calls with "
                                    f"the same kinds of arguments returned {len(out)} tensors")
                for h, x in zip(out, r):
                    self.objs[h] = x
        except Exception as e:
            self.fail(f"{name} (command {self.seq})", _describe(e), self._lost(out, args, name))

    def _lost(self, out, args, name):
        """The handles a failed call leaves failed: its outputs, or, in place, its target."""
        if type(out) is not int:
            return list(out)
        if out >= 0:
            return [out]
        if args and type(args[0]) is Ref and args[0].hid in self.objs and self.table.get(name) \
                is not None and self.table[name].inplace:
            return [args[0].hid]
        return []

    def call_reply(self, name, out, args, kwargs=None):
        """A call whose result's kind the master does not know yet: reply with its
        structure (tensors as their metadata, values as plain data); keep the tensors
        under ``out`` for a following bind."""
        try:
            r = self._run_call(name, args, kwargs)
        except Exception as e:
            # as a queued call's failure: the result is failed, reported at the next sync
            # point (not with this reply, which the master reads at once)
            self.reply(("F",))
            self.fail(f"{name} (command {self.seq})", _describe(e), [out])
            return
        try:
            tensors = []
            struct = self._struct(r, tensors, 0)
            encode(struct)
        except Exception as e:
            self.reply(f"{name}: {_describe(e)}", ok=False)
            return
        if tensors:
            self.objs[out] = r if struct[0] == "T" else tensors
        self.reply(struct)

    def _struct(self, r, tensors, depth):
        lib = self.lib
        if lib.is_array(r):
            tensors.append(r)
            return ("T",) + lib.meta(r)
        t = type(r)
        if r is None or t in (bool, int, float, complex, str, bytes):
            return ("V", r)
        if depth > 8:
            raise TypeError("the result is nested too deeply to come back")
        if isinstance(r, tuple) and hasattr(r, "n_fields") and t.__module__ == "torch.return_types":
            return ("R", t.__name__, [self._struct(x, tensors, depth + 1) for x in r])
        if lib.name == "torch":
            torch = lib.torch
            if t is torch.Size:
                return ("S", tuple(r))
            if t is torch.dtype:
                return ("D", str(r)[6:])
            if t is torch.device:
                return ("E", str(r))
            if t is torch.layout or t is torch.memory_format:
                return ("C", ("layout:" if t is torch.layout else "memory_format:") + str(r)[6:])
        if t is tuple or t is list:
            return (t.__name__, [self._struct(x, tensors, depth + 1) for x in r])
        if t is dict and all(type(k) is str for k in r):
            return ("dict", {k: self._struct(x, tensors, depth + 1) for k, x in r.items()})
        if isinstance(r, np.generic):
            return ("V", r.item())
        if isinstance(r, np.ndarray):
            return ("V", r)
        raise TypeError(f"it returned a {t.__name__}, which cannot come back to the master")

    def bind(self, out, hids):
        """The tensors of a replied call's result, in order, under the master's ids."""
        tensors = self.objs.pop(out, None)
        if tensors is None:
            self.fail(f"bind (command {self.seq})", f"no result {out} to bind", hids)
            return
        for h, x in zip(hids, tensors):
            self.objs[h] = x

    def send_to(self, hid, dst):
        try:
            obj = self.resolve(Ref(hid))
            host = self.lib.host(obj)
            hdr = frame(0, self.lib.meta(obj)[:2])
        except Exception as e:
            hdr, host = frame(1, _describe(e)[:2000]), None  # fits the receiver's header buffer
            self.fail(f"to_node (command {self.seq})", _describe(e), [])
        self.isend(np.frombuffer(hdr, np.uint8), dst, P.T_W2W)
        if host is not None:
            self.isend(host, dst, P.T_W2W_DATA)

    def recv_from(self, out, src):
        hdr = np.empty(4096, np.uint8)
        self.recv_into(hdr, src, P.T_W2W, f"to_node: receiving from rank {src}")
        status, meta = unframe(hdr)
        if status:
            self.fail(f"to_node (command {self.seq})", f"the sending node failed: {meta}", [out])
            return
        host = self.lib.alloc("empty", tuple(meta[0]), meta[1], None, -1)
        self.recv_into(host, src, P.T_W2W_DATA, f"to_node: receiving from rank {src}")
        self.objs[out] = host

    def group(self, ranks):
        g = self.groups.get(ranks)
        if g is None:
            g = new_group(list(ranks), use_local_synchronization=True)
            self.groups[ranks] = g
        return g

    def collective(self, kind, hid, ranks, opname, root, out):
        what = f"{kind} (command {self.seq})"
        g = self.group(tuple(ranks))  # every member makes it, in command order
        lost = [out] if out >= 0 else []
        # first a small agreement among the members: whether every input exists, and its
        # size and dtype; a member whose input failed, or a mismatch, fails them all now
        # (instead of peers waiting for it until their timeout, or reducing garbage)
        t, why = None, None
        try:
            t = self.resolve(Ref(hid))
            shape, dtype, _ = self.lib.meta(t)
            if opname not in _REDUCE_NAMES:
                raise ValueError(f"unknown reduce op {opname!r}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * (2 if dtype == "bfloat16" else
                                                            np.dtype(dtype).itemsize)
            code = _DTYPE_CODES.index(dtype)
            flags = np.array([0, nbytes, -nbytes, code, -code], np.int64)
        except Exception as e:
            why = _describe(e)
            flags = np.array([1, 0, 0, 0, 0], np.int64)
        try:
            _coll.all_reduce(flags, op=ReduceOp.MAX, group=g)
        except DistError as e:
            self.fail(what, _describe(e), lost)
            return
        if why is not None:
            self.fail(what, why, lost)
            return
        if flags[0]:
            self.fail(what, "another node's input to it failed", lost)
            return
        if flags[1] != -flags[2] or flags[3] != -flags[4]:
            self.fail(what, "the nodes' tensors differ in size or dtype", lost)
            return
        try:
            if kind == "all_reduce":
                _coll.all_reduce(t, op=getattr(ReduceOp, opname), group=g)
            elif kind == "broadcast":
                _coll.broadcast(t, src=root, group=g)
            elif kind == "all_gather":
                shape, dtype, _ = self.lib.meta(t)
                o = self.lib.alloc("empty", (len(ranks),) + tuple(shape), dtype, None, -1)
                _coll.all_gather_into_tensor(o, t, group=g)
                self.objs[out] = o
            else:
                raise ValueError(f"unknown collective {kind!r}")
        except Exception as e:
            self.fail(what, _describe(e), lost)

    def rpc(self, name, out, args, kwargs, want_reply):
        what = f"rpc {name!r} (command {self.seq})"
        try:
            fn = lookup(name)
            result = fn(*self.resolve(args), **self.resolve(kwargs))
        except Exception as e:
            if out >= 0:
                self.fail(what, _describe(e), [out])
            if want_reply:
                self.reply(f"{what} raised {_describe(e)}", ok=False)
            return
        if out >= 0:
            self.objs[out] = result
        if want_reply:
            try:
                payload = _plain(self.lib, result)
                encode(payload)
            except Exception as e:
                self.reply(f"{what}: its result cannot be sent back: {_describe(e)}", ok=False)
                return
            self.reply(payload)


_EMPTY = np.empty(0, np.uint8)


class _InputFailed(RuntimeError):
    pass


def _describe(e):
    return f"{type(e).__name__}: {e}"


def _plain(lib, v):
    """A registered function's result as plain data (arrays/tensors -> NumPy arrays)."""
    if lib.is_array(v):
        h = lib.host(v)
        return h if isinstance(h, np.ndarray) else h.numpy()
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(lib, x) for x in v)
    if isinstance(v, dict):
        return {k: _plain(lib, x) for k, x in v.items()}
    return v


def _rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return -1


def run_worker(pg, lib, master_pid, same_host, timeout):
    """Serve the master until it ends, then leave the process (never returns)."""
    w = Worker(pg, lib, master_pid, same_host, timeout)
    code = 0
    try:
        w.serve()
    except MasterGone as e:
        print(f"collectives master-worker: node {w.node} exits: {e}", file=sys.stderr)
        code = 1
    except DistError as e:
        print(f"collectives master-worker: node {w.node} exits: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        destroy_process_group()
    except Exception:  # the master may be gone; this process ends either way
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
