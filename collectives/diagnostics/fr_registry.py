"""The flight recorder's registry (see :mod:`collectives.diagnostics.flight_recorder`): its settings,
the process's recorders (live groups, and recently destroyed ones), this process's
global rank, and how a ring entry reads as a call (:func:`describe`)."""
import os
import threading
import weakref

from .. import config
from ..core import dtypes as D

KEEP_ENDED = 16  # recorders of destroyed groups kept for later dumps

# torch's names first, as torch users expect
BUFFER_SIZE = config.get("COLLECTIVES_FR_BUFFER_SIZE", first="TORCH_FR_BUFFER_SIZE")
ENABLED = BUFFER_SIZE > 0
DUMP_PREFIX = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or config.get("COLLECTIVES_FR_DUMP") or None
STACKS = config.get("COLLECTIVES_FR_STACK")

_ROOT_ARG = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}


def describe(e, ranks=None):
    """``broadcast(src=1, float32, 100)``: a ring entry as a user would have written the call."""
    _, kind, count, dtype, root, op = e[:6]
    parts = []
    if root >= 0:
        shown = ranks[root] if ranks is not None and root < len(ranks) else root
        parts.append(f"{_ROOT_ARG.get(kind.split('_')[0], 'root')}={shown}")
    if dtype >= 0:
        parts.append(D.DTYPE_NAMES.get(dtype, f"dtype {dtype}"))
    if kind not in ("barrier", "monitored_barrier"):
        parts.append(str(count))
    if op >= 0:
        parts.append(f"op={D.OP_NAMES.get(op, op)}")
    return f"{kind}({', '.join(parts)})"


# ---- the process's recorders --------------------------------------------------------------

_lock = threading.Lock()
_live = []  # (weakref to the group, recorder)
_ended = []  # recorders of destroyed groups, newest last
_global_rank = None
_world_size = None



def register(pg, fr):
    """Register ``fr``, the recorder of a new group ``pg``, for dumps and progress posts."""
    with _lock:
        _prune()
        _live.append((weakref.ref(pg), fr))


def _prune():
    """Move recorders of destroyed groups to ``_ended`` (caller holds ``_lock``)."""
    keep = []
    for ref, fr in _live:
        pg = ref()
        if pg is None or getattr(pg, "destroyed", False):
            fr.ended = True
            _ended.append(fr)
        else:
            keep.append((ref, fr))
    _live[:] = keep
    del _ended[:-KEEP_ENDED]


def recorders():
    """This process's recorders: live groups first, then recently destroyed ones."""
    with _lock:
        _prune()
        return [fr for _, fr in _live] + list(reversed(_ended))


def live_recorders():
    with _lock:
        _prune()
        return [fr for _, fr in _live]


def global_rank():
    """This process's rank in the default group (the last one known after it is gone)."""
    global _global_rank, _world_size
    from ..core.world import world
    pg = world.default
    if pg is not None:
        _global_rank, _world_size = pg._rank, pg._size
    if _global_rank is not None:
        return _global_rank
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0




def world_size():
    """The default group's size, as :func:`global_rank` last saw it (None before)."""
    return _world_size
