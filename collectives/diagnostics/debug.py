"""torch's debug levels: ``DebugLevel``, ``get_debug_level``, ``set_debug_level``,
``set_debug_level_from_env`` (``TORCH_DISTRIBUTED_DEBUG=OFF|INFO|DETAIL``, read at import
as torch does).

* INFO: each new group is logged (logger ``collectives``, level INFO).
* DETAIL: in addition, a group made while DETAIL is set checks every collective before
  running it, as torch's ProcessGroupWrapper does: the ranks exchange a fingerprint
  (sequence number, collective, dtype, element count, root, reduce op) and, where any two
  differ, every rank raises DistBackendError naming both, instead of hanging or mixing up
  data. It costs one small all_gather per collective. Point-to-point calls are not checked,
  nor are nccl groups (the fingerprints are host arrays).
"""
import enum
import logging
import os

import numpy as np

from ..core import dtypes as D
from ..core.convert import buffer
from ..core.errors import DistBackendError

_log = logging.getLogger("collectives")


class DebugLevel(enum.IntEnum):
    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self):
        return f"DebugLevel.{self.name}"


_level = DebugLevel.OFF


def get_debug_level():
    """The current level (a DebugLevel)."""
    return _level


def set_debug_level(level):
    """Set the level; groups made afterwards follow it (DETAIL checks)."""
    global _level
    if not isinstance(level, DebugLevel):
        raise TypeError(f"level must be a DebugLevel (OFF, INFO or DETAIL), got {level!r}")
    _level = level


def set_debug_level_from_env():
    """Set the level from TORCH_DISTRIBUTED_DEBUG (OFF when unset; any case)."""
    value = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF").strip().upper()
    if value not in DebugLevel.__members__:
        raise ValueError("The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, or DETAIL.")
    set_debug_level(DebugLevel[value])


def on_new_group(backend, name, ranks, rank, backend_name):
    """The backend a new group uses at the current level (``backend`` itself below DETAIL)."""
    if _level >= DebugLevel.INFO:
        _log.info("collectives: group %s: rank %d of %d (global ranks %s), backend %s",
                  name, rank, len(ranks), list(ranks), backend_name)
    if _level >= DebugLevel.DETAIL and not getattr(backend, "takes_cuda", False):
        return CheckedBackend(backend, name)
    return backend


# ---- DETAIL: collective fingerprints ------------------------------------------------------

_KINDS = ["broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
          "all_to_all", "barrier"]
_KIND_CODE = {k: i for i, k in enumerate(_KINDS)}
_FIELDS = 6  # sequence, kind, dtype, count, root, op


def _describe(row):
    seq, kind, dtype, count, root, op = (int(x) for x in row)
    parts = [f"SequenceNumber={seq}", f"OpType={_KINDS[kind].upper()}"]
    if dtype >= 0:
        parts.append(f"TensorDtype={D.DTYPE_NAMES[dtype]}")
    if count >= 0:
        parts.append(f"NumElements={count}")
    if root >= 0:
        parts.append(f"Root={root}")
    if op >= 0:
        parts.append(f"ReduceOp={D.OP_NAMES.get(op, op)}")
    return f"CollectiveFingerPrint({', '.join(parts)})"


class CheckedBackend:
    """Wraps a group's backend: every collective first compares fingerprints across ranks.

    Everything else (p2p, split, shutdown, run/submit, attributes) is the wrapped backend's.
    The check runs where the collective runs (the caller's thread, or the progress thread
    for async ones), so it keeps issue order.
    """

    def __init__(self, inner, name):
        self._inner = inner
        self._name = name
        self._seq = 0

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def _check(self, kind, dtype=-1, count=-1, root=-1, op=-1):
        be = self._inner
        self._seq += 1
        mine = np.array([self._seq, _KIND_CODE[kind], dtype, count, root, op], np.int64)
        rows = np.empty((be.size, _FIELDS), np.int64)
        be.all_gather(buffer(rows), buffer(mine))
        bad = np.flatnonzero((rows != rows[0]).any(axis=1))
        if bad.size:
            q = int(bad[0])
            raise DistBackendError(
                f"Detected mismatch between collectives on ranks of group {self._name}. "
                f"Rank 0 is running collective: {_describe(rows[0])}, but Rank {q} is running "
                f"collective: {_describe(rows[q])}")

    def broadcast(self, buf, root):
        self._check("broadcast", buf.dtype, buf.count, root)
        return self._inner.broadcast(buf, root)

    def all_reduce(self, buf, op):
        self._check("all_reduce", buf.dtype, buf.count, op=op)
        return self._inner.all_reduce(buf, op)

    def reduce(self, buf, op, root):
        self._check("reduce", buf.dtype, buf.count, root, op)
        return self._inner.reduce(buf, op, root)

    def all_gather(self, out, inp):
        self._check("all_gather", inp.dtype, inp.count)
        return self._inner.all_gather(out, inp)

    def all_gather_list(self, outs, inp):
        self._check("all_gather", inp.dtype, inp.count)
        return self._inner.all_gather_list(outs, inp)

    def gather(self, out, inp, root):
        self._check("gather", inp.dtype, inp.count, root)
        return self._inner.gather(out, inp, root)

    def scatter(self, out, inp, root):
        self._check("scatter", out.dtype, out.count, root)
        return self._inner.scatter(out, inp, root)

    def reduce_scatter(self, out, inp, op):
        self._check("reduce_scatter", out.dtype, out.count, op=op)
        return self._inner.reduce_scatter(out, inp, op)

    def all_to_all(self, out, inp, out_counts, in_counts):
        self._check("all_to_all", inp.dtype)  # counts differ by rank in uneven exchanges
        return self._inner.all_to_all(out, inp, out_counts, in_counts)

    def barrier(self):
        self._check("barrier")
        return self._inner.barrier()
