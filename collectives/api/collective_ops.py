"""Collectives: broadcast, all_reduce, reduce, all_gather, gather, scatter, reduce_scatter,
all_to_all, barrier (torch.distributed signatures).

Each function is written from its entry in :data:`collectives.api.opspec.SPECS` (the table
that describes each collective once) into :mod:`collectives.api._generated` by
:mod:`collectives.api.gen`: it resolves the group (None on a rank outside it), checks and
converts the tensors, and hands the call to the group's dispatcher (``pg.dispatch.call``:
see :mod:`collectives.api.group_dispatcher`), which records it, runs it blocking or queues it, and
returns a Work when async. The ProcessGroup methods (``pg.allreduce(...)``) call these
same functions with ``group=`` their group.
"""
from ._generated import (
    all_gather, all_gather_coalesced, all_gather_single, all_reduce, all_reduce_coalesced,
    all_to_all, all_to_all_single, barrier, broadcast, gather, reduce, reduce_scatter,
    reduce_scatter_single, scatter)
from .monitored_barrier import monitored_barrier  # point to point, not a collective call

all_gather_into_tensor = all_gather_single
_all_gather_base = all_gather_single
reduce_scatter_tensor = reduce_scatter_single
_reduce_scatter_base = reduce_scatter_single

__all__ = ["all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
           "all_gather_single", "all_gather_into_tensor", "all_gather_coalesced",
           "_all_gather_base", "gather", "scatter",
           "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
           "_reduce_scatter_base", "all_to_all", "all_to_all_single", "barrier",
           "monitored_barrier"]
