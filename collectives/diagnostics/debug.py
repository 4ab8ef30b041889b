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
from ..core.fingerprint import COLLECTIVES, KIND_NAMES

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

_FIELDS = 6  # sequence, kind, dtype, count, root, op


def _describe(row):
    seq, kind, dtype, count, root, op = (int(x) for x in row)
    parts = [f"SequenceNumber={seq}", f"OpType={KIND_NAMES[kind].upper()}"]
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
        """Compare this call's fingerprint (``kind``: its code, collectives.core.fingerprint)
        with every rank's; DistBackendError on every rank where any two differ."""
        be = self._inner
        self._seq += 1
        mine = np.array([self._seq, kind, dtype, count, root, op], np.int64)
        rows = np.empty((be.size, _FIELDS), np.int64)
        be.all_gather(buffer(rows), buffer(mine))
        bad = np.flatnonzero((rows != rows[0]).any(axis=1))
        if bad.size:
            q = int(bad[0])
            raise DistBackendError(
                f"Detected mismatch between collectives on ranks of group {self._name}. "
                f"Rank 0 is running collective: {_describe(rows[0])}, but Rank {q} is running "
                f"collective: {_describe(rows[q])}")


# what each collective of the catalogue (collectives.core.fingerprint.COLLECTIVES) gives its
# fingerprint from its arguments: (dtype, count, root, op), -1 for none
_FINGERPRINTED = {
    "broadcast": lambda buf, root: (buf.dtype, buf.count, root, -1),
    "all_reduce": lambda buf, op: (buf.dtype, buf.count, -1, op),
    "reduce": lambda buf, op, root: (buf.dtype, buf.count, root, op),
    "all_gather": lambda out, inp: (inp.dtype, inp.count, -1, -1),
    "all_gather_list": lambda outs, inp: (inp.dtype, inp.count, -1, -1),
    "gather": lambda out, inp, root: (inp.dtype, inp.count, root, -1),
    "scatter": lambda out, inp, root: (out.dtype, out.count, root, -1),
    "reduce_scatter": lambda out, inp, op: (out.dtype, out.count, -1, op),
    # counts differ by rank in uneven exchanges: the dtype only
    "all_to_all": lambda out, inp, out_counts, in_counts: (inp.dtype, -1, -1, -1),
    "barrier": lambda: (-1, -1, -1, -1),
}


def _checked(name, kind, fields):
    """CheckedBackend's ``name``: the fingerprints compared, then the wrapped backend's call."""
    def call(self, *args):
        self._check(kind, *fields(*args))
        return getattr(self._inner, name)(*args)
    call.__name__, call.__qualname__ = name, f"CheckedBackend.{name}"
    call.__doc__ = f"The wrapped backend's ``{name}``, once every rank's fingerprint agrees."
    return call


# one forwarder per collective of the catalogue (a KeyError here: a collective whose
# fingerprint fields _FINGERPRINTED does not give)
for _name, _kind in COLLECTIVES.items():
    setattr(CheckedBackend, _name, _checked(_name, _kind, _FINGERPRINTED[_name]))
