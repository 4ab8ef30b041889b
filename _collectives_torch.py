"""The backend name ``"collectives"`` in torch.distributed, registered at the cost of a few
dictionary entries: neither collectives nor torch is imported here.

Two ways in:

- torch's device-backend autoload: torch calls :func:`autoload` (this distribution's
  ``torch.backends`` entry point) at the end of ``import torch``, unless
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``; so ``torch.distributed.init_process_group("collectives")``
  works in a program that never imports collectives.
- ``import collectives`` calls :func:`install`, with torch imported before or after (or
  never: then nothing of torch is imported).

Either registers the name with a creator that imports the bridge
(``collectives.torch_bridge.torch_pg``) only when torch calls it, at the first
``init_process_group("collectives")`` or ``new_group(backend="collectives")``. Where
``torch.distributed`` is not imported yet, an import hook registers the name right after
torch imports it. This module lives outside the package: importing ``collectives.anything``
runs ``collectives/__init__.py``, which torch's import must not pay for.
"""
import sys
import threading

BACKEND_NAME = "collectives"
_DIST = "torch.distributed"
_lock = threading.Lock()


def _create(*args, **kwargs):
    """torch's creator for the backend: the bridge's, imported at the first call."""
    from collectives.torch_bridge import torch_pg
    return torch_pg._create(*args, **kwargs)


def register(td):
    """Register the backend name with ``td`` (an imported torch.distributed) unless it is
    registered already (by this module, or by the bridge itself); whether it is now."""
    if not getattr(td, "is_available", lambda: False)():
        return False
    backend = td.Backend
    with _lock:
        if BACKEND_NAME.upper() not in backend._plugins:
            backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                     devices=["cpu", "cuda"])
    return True


class _Loader:
    """torch.distributed's own loader, which registers the name once the module ran."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = self._loader  # the module keeps the loader it would have had
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        try:
            register(module)
        except Exception as e:  # noqa: BLE001  (torch's import must not fail for us)
            import warnings
            warnings.warn(f"collectives: could not register the torch.distributed backend "
                          f"{BACKEND_NAME!r}: {e!r}", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name):  # get_code, get_source, is_package... are the loader's
        return getattr(self._loader, name)


class _Finder:
    """A meta-path finder that answers only for torch.distributed: the spec the other
    finders give, with :class:`_Loader` around its loader. It takes itself off the path
    at its first answer."""

    def find_spec(self, name, path=None, target=None):
        if name != _DIST:
            return None
        _remove()
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


_finder = _Finder()


def _remove():
    with _lock:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass


def install():
    """Register the name now where torch.distributed is imported, else when it is (no
    import of torch here). Safe to call more than once."""
    td = sys.modules.get(_DIST)
    if td is not None and hasattr(td, "Backend"):
        register(td)
        return
    if td is not None:  # torch.distributed is being imported: it is too late to hook it
        return
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def autoload():
    """torch's ``torch.backends`` entry point (called at the end of ``import torch``)."""
    install()
