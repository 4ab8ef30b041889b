"""torch's ``*Options`` structs for ProcessGroup's own collective methods
(``pg.allreduce([t], opts)``): plain attribute holders with torch's names and defaults.

``timeout`` defaults to torch's "unset" value (-1 ms): the group's timeout applies.
Ranks in them (``rootRank``) are ranks of the group the method is called on.
"""
from datetime import timedelta

from .reduce_op import ReduceOp

__all__ = ["AllToAllOptions", "AllgatherOptions", "AllreduceCoalescedOptions", "AllreduceOptions",
           "BarrierOptions", "BroadcastOptions", "GatherOptions", "ReduceOptions",
           "ReduceScatterOptions", "ScatterOptions"]

UNSET_TIMEOUT = timedelta(milliseconds=-1)


class _Options:
    _defaults = {}

    def __init__(self):
        self.timeout = UNSET_TIMEOUT
        self.asyncOp = True
        for k, v in self._defaults.items():
            setattr(self, k, list(v) if isinstance(v, list) else v)

    def __repr__(self):
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._defaults)
        return f"{type(self).__name__}({fields})"


class AllreduceOptions(_Options):
    _defaults = {"reduceOp": ReduceOp.SUM}


class AllreduceCoalescedOptions(AllreduceOptions):
    pass


class BroadcastOptions(_Options):
    _defaults = {"rootRank": 0, "rootTensor": 0}


class ReduceOptions(_Options):
    _defaults = {"reduceOp": ReduceOp.SUM, "rootRank": 0, "rootTensor": 0}


class AllgatherOptions(_Options):
    pass


class GatherOptions(_Options):
    _defaults = {"rootRank": 0}


class ScatterOptions(_Options):
    _defaults = {"rootRank": 0}


class ReduceScatterOptions(_Options):
    _defaults = {"reduceOp": ReduceOp.SUM}


class AllToAllOptions(_Options):
    pass


class BarrierOptions(_Options):
    _defaults = {"device_ids": [], "device": None}
