"""Whether the package, a backend or a launcher is there (torch's ``is_*_available``)."""
import importlib.util
import os

from .. import backends as _backends


def is_available():
    return True


def _found(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def is_gloo_available():
    # gloo runs on the compiled _tcp engine: absent where the extensions are not built, and
    # hidden (None in sys.modules, so find_spec answers None) under COLLECTIVES_NO_EXTENSIONS
    return _found("collectives.backends.tcp") and _found("collectives.engines._tcp")


def is_mpi_available():
    return _found("mpi4py") and _found("collectives.backends.mpi")


def is_nccl_available():
    if not (_found("collectives.backends.nccl") and _found("torch")):
        return False
    import torch
    return torch.cuda.is_available()


def is_ucc_available():
    return False  # no ucc backend here


def is_xccl_available():
    return False  # no xccl backend here


_BUILTIN_CHECK = {"gloo": is_gloo_available, "tcp": is_gloo_available,
                  "mpi": is_mpi_available, "nccl": is_nccl_available}


def is_backend_available(backend):
    """Whether ``init_process_group(backend)`` can work here."""
    key = str(backend).lower()
    if key not in _backends.registered_backends():
        return False
    check = _BUILTIN_CHECK.get(key)
    return True if check is None else check()


def is_torchelastic_launched():
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None

