"""The torch bridge: our groups as torch.distributed's (``torch_pg``, with ``torch_work`` and
``torch_store``) and torch's ``ProcessGroupGloo`` constructor (``gloo``).

Only ``torch_pg`` and its helpers import torch. This package's ``__init__`` does not (the
package imports it, with torch or without): it registers the hook through which
``api/group.py``, a layer below, reaches the bridge without importing it. ``torch_pg``
registers itself when it is imported.
"""
from ..api import group as _group


def _load():
    """``torch_pg``, imported now (a world bridges: torch is imported); None where
    torch.distributed is unavailable."""
    import torch.distributed
    if not torch.distributed.is_available():
        return None
    from . import torch_pg
    return torch_pg


_group.set_torch_bridge(load=_load)
