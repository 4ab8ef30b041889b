"""Collectives that autograd differentiates: ``torch.distributed.nn``'s functions.

``import collectives.nn`` (or use ``dist.nn`` after ``import collectives as dist``)
where a program wrote ``import torch.distributed.nn``; see
:mod:`collectives.nn.functional`. Needs torch.
"""
try:
    import torch  # noqa: F401
except ModuleNotFoundError as _e:
    raise ModuleNotFoundError(
        "collectives.nn (autograd collectives) needs torch: pip install 'collectives[torch]'",
        name="torch") from _e

from .functional import (  # noqa: F401,E402
    _all_gather_base, all_gather, all_reduce, all_to_all, all_to_all_single, broadcast, gather,
    reduce, reduce_scatter, scatter)

__all__ = ["all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather",
           "reduce", "reduce_scatter", "scatter"]
