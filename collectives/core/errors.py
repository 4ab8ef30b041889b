"""Exceptions, spelled as torch.distributed spells them.

Misuse raises ValueError/TypeError before any communication; failures of the
communication itself raise a DistError subclass.
"""


class DistError(RuntimeError):
    """A collective or point-to-point operation failed (torch.distributed.DistError)."""


class DistBackendError(DistError):
    """The backend failed: a peer closed its connection, a frame did not match, a wait timed out."""


class DistNetworkError(DistError):
    """A network operation (connect, accept, send, recv) failed."""


class DistStoreError(DistError):
    """A store operation failed or timed out (torch.distributed.DistStoreError)."""


__all__ = ["DistError", "DistBackendError", "DistNetworkError", "DistStoreError"]
