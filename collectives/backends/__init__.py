"""Backend registry: names to factories.

``register_backend(name, factory)`` adds a backend; ``factory(store, rank, size,
timeout, options)`` returns a :class:`~collectives.backends.base.Backend`.
Built-in backends are imported lazily, so a missing optional dependency (mpi4py,
a CUDA torch) only matters to the user who asks for that backend.
"""
import importlib

from .base import Backend, DoneRequest, FutureRequest, Request

# name -> "module:attribute" for built-ins (imported on first use), or a callable
_REGISTRY = {
    "gloo": "collectives.backends.select:create_default_backend",
    "tcp": "collectives.backends.select:create_default_backend",
    "mpi": "collectives.backends.mpi:create_mpi_backend",
    "nccl": "collectives.backends.nccl:create_nccl_backend",
}
_ALIASES = {"tcp": "gloo"}


def register_backend(name, factory, extended_api=False, devices=None):
    """Register ``factory`` under ``name`` (case-insensitive), as torch's Backend.register_backend.

    Raises ValueError if the name is taken, TypeError if factory is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    key = name.lower()
    if key in _REGISTRY:
        raise ValueError(f"backend {name!r} is already registered")
    _REGISTRY[key] = factory


def registered_backends():
    """Names that ``get_backend_factory`` accepts."""
    return sorted(_REGISTRY)


def canonical_name(name):
    key = name.lower()
    return _ALIASES.get(key, key)


def get_backend_factory(name):
    """The factory for ``name``; ValueError naming the registered ones if unknown."""
    key = name.lower() if isinstance(name, str) else name
    entry = _REGISTRY.get(key)
    if entry is None:
        raise ValueError(f"Invalid backend: {name!r}; expected one of {', '.join(registered_backends())}")
    if isinstance(entry, str):
        mod, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(mod), attr)
        _REGISTRY[key] = entry
    return entry


__all__ = ["Backend", "Request", "DoneRequest", "FutureRequest", "register_backend",
           "registered_backends", "get_backend_factory", "canonical_name"]
