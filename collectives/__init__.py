"""collectives: the torch.distributed process-group API, Cython-accelerated.

``import collectives as dist`` in a program written for torch.distributed.
"""
from . import dtypes
from .errors import DistBackendError, DistError, DistNetworkError, DistStoreError

__version__ = "0.1.0"
