"""Unpickling for the object collectives, with a safe mode in the spirit of torch's
``weights_only``: plain data, NumPy arrays and torch tensors only.

A pickle may name any importable callable, and unpickling calls it: a peer that can
send an object can run code in the receiver. The object calls (``all_gather_object``
and the rest) unpickle what other ranks send, so they are for peers that trust each
other, as in torch.distributed; under ``collectives-run`` only processes holding the
job's key can be peers (docs/security.md). The safe mode refuses any global outside
an allow-list, so a hostile peer can only send data:

* builtins: None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict,
  set, frozenset, slice, range; collections.OrderedDict and deque; datetime's types;
* NumPy arrays, dtypes and scalars (not object arrays' elements beyond the above);
* torch tensors, parameters, dtypes, devices and Size, storages loaded with
  ``torch.load(weights_only=True)`` instead of torch's own unrestricted loader.

Choose it per call (``safe=True`` on each object call) or for the process with
COLLECTIVES_SAFE_OBJECTS=1 (default 0: full pickle, torch's behaviour).
"""
import io
import pickle

from .. import config

SAFE_ENV = "COLLECTIVES_SAFE_OBJECTS"

_PLAIN = {
    ("builtins", n) for n in ("set", "frozenset", "bytearray", "complex", "slice", "range",
                              "int", "float", "str", "bytes", "bool", "list", "tuple", "dict")
}
_PLAIN |= {("collections", "OrderedDict"), ("collections", "deque")}
_PLAIN |= {("datetime", n) for n in ("datetime", "date", "time", "timedelta", "timezone")}
_NUMPY = {("numpy", "ndarray"), ("numpy", "dtype"),
          ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
          ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar")}
_TORCH = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
          ("torch", "device"), ("torch", "Size")}


def safe_default():
    """Whether the object calls unpickle in safe mode when a call does not say
    (COLLECTIVES_SAFE_OBJECTS, a bool by the settings registry's rule: unset, ``0``,
    ``false``, ``no``, ``off`` are no, anything else yes)."""
    return config.get(SAFE_ENV)


def check_safe(safe, name="safe"):
    """The per-call ``safe`` argument resolved: None takes the setting."""
    if safe is None:
        return safe_default()
    if not isinstance(safe, bool):
        raise TypeError(f"{name} must be True, False or None, got {type(safe).__name__}")
    return safe


def _torch_storage_from_bytes(b):
    import torch
    return torch.load(io.BytesIO(b), weights_only=True)


class SafeUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only allow-listed globals (see the module docstring)."""

    def __init__(self, file, origin):
        super().__init__(file)
        self._origin = origin

    def find_class(self, module, name):
        key = (module, name)
        if key in _PLAIN or key in _NUMPY or key in _TORCH:
            return super().find_class(module, name)
        if key == ("torch.storage", "_load_from_bytes"):
            return _torch_storage_from_bytes
        if module == "torch":
            import torch
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(
            f"safe mode refused to unpickle {module}.{name} from {self._origin}: only plain "
            f"data, NumPy arrays and torch tensors are allowed (pass safe=False, or set "
            f"{SAFE_ENV}=0, for peers you trust)")


def loads(data, safe, origin):
    """Unpickle ``data`` (bytes) sent by ``origin`` (e.g. "rank 3"), safely if ``safe``."""
    if not safe:
        return pickle.loads(data)
    return SafeUnpickler(io.BytesIO(data), origin).load()


__all__ = ["SAFE_ENV", "SafeUnpickler", "check_safe", "loads", "safe_default"]
