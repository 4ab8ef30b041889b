"""Collectives: broadcast, all_reduce, reduce, all_gather, gather, scatter, reduce_scatter,
all_to_all, barrier (torch.distributed signatures).

Each function is made from its entry in :data:`collectives.api.opspec.SPECS` (the table that
describes each collective once): it resolves the group (None on a rank outside it),
checks and converts the tensors, and hands the call to the group's dispatcher
(``pg.dispatch.call``: see :mod:`collectives.api.group_dispatcher`), which records it, runs it
blocking or queues it, and returns a Work when async. The ProcessGroup methods
(``pg.allreduce(...)``) run the same entries on their group (``SPECS[name].run``).
"""
from .opspec import SPECS, build
from .monitored_barrier import monitored_barrier  # point to point, not a collective call

_DOCS = {
    "all_reduce": """Reduce ``tensor`` across the group, in place, on every rank.

    Args:
        tensor: a contiguous torch CPU tensor or NumPy array (any shape).
        op: a ReduceOp (AVG and PREMUL_SUM need floating or complex tensors).
        group: the group (default: the world).
        async_op: return a Work instead of waiting.

    Example:
        >>> t = torch.ones(2); dist.all_reduce(t)   # t == world_size
    """,
    "all_reduce_coalesced": "all_reduce of several tensors of one dtype in one backend call.",
    "reduce": "Reduce ``tensor`` across the group into ``dst``'s tensor; the others keep theirs.",
    "broadcast": "Copy ``src``'s tensor into every rank's ``tensor``.",
    "all_gather": "Gather every rank's ``tensor`` into ``tensor_list`` (one tensor per rank) "
                  "on every rank.",
    "all_gather_single": "Gather every rank's ``input_tensor`` into ``output_tensor`` "
                         "(size * numel elements).",
    "all_gather_coalesced": """Gather every rank's ``input_tensor_list`` in one backend call
    (torch's deprecated coalesced form): ``output_tensor_lists[r][i]`` receives rank r's
    ``input_tensor_list[i]``. The tensors share one dtype, as torch's gloo requires; their
    shapes may differ.""",
    "gather": "Gather every rank's ``tensor`` into ``gather_list`` on ``dst`` (None elsewhere).",
    "scatter": "Rank r receives ``scatter_list[r]`` of ``src`` into ``tensor``.",
    "reduce_scatter": "Rank r's ``output`` gets the reduction over ranks of their "
                      "``input_list[r]``.",
    "reduce_scatter_single": "Rank r's ``output`` gets the reduction of slice r of every "
                             "rank's ``input``.",
    "all_to_all": "Rank r sends ``input_tensor_list[q]`` to rank q, which receives it in "
                  "``output_tensor_list[r]``.",
    "all_to_all_single": """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``),
    send part q to rank q; receive rank r's part into ``output``'s r-th slice (``output_split_sizes``).""",
    "barrier": """Block until every rank of the group has reached this barrier.

    ``timeout`` (a timedelta or seconds, > 0) bounds this barrier instead of the group's
    timeout; past it, DistBackendError ("Timed out waiting <n>ms ..."), as torch's gloo.
    """,
}

all_reduce = build(SPECS["all_reduce"], _DOCS["all_reduce"])
all_reduce_coalesced = build(SPECS["all_reduce_coalesced"], _DOCS["all_reduce_coalesced"])
reduce = build(SPECS["reduce"], _DOCS["reduce"])
broadcast = build(SPECS["broadcast"], _DOCS["broadcast"])
all_gather = build(SPECS["all_gather"], _DOCS["all_gather"])
all_gather_single = build(SPECS["all_gather_single"], _DOCS["all_gather_single"])
all_gather_coalesced = build(SPECS["all_gather_coalesced"], _DOCS["all_gather_coalesced"])
gather = build(SPECS["gather"], _DOCS["gather"])
scatter = build(SPECS["scatter"], _DOCS["scatter"])
reduce_scatter = build(SPECS["reduce_scatter"], _DOCS["reduce_scatter"])
reduce_scatter_single = build(SPECS["reduce_scatter_single"], _DOCS["reduce_scatter_single"])
all_to_all = build(SPECS["all_to_all"], _DOCS["all_to_all"])
all_to_all_single = build(SPECS["all_to_all_single"], _DOCS["all_to_all_single"])
barrier = build(SPECS["barrier"], _DOCS["barrier"])

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
