"""Functions callable by name through rpc_sync / rpc_async / remote.

Every rank runs the program up to ``init_master_worker``, so a function registered
before that call (or at import, with the decorator) exists under the same name on the
master and on every worker. The wire carries only the name; a worker runs nothing else.
"""
import re

_FUNCTIONS = {}
_NAMES = {}  # id(fn) -> name, so the master may pass the function itself
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,200}$")


def register_function(name_or_fn=None, fn=None):
    """Register ``fn`` under ``name`` for remote calls; usable as a decorator.

    Call it on every rank before ``init_master_worker`` (module level does that).

    Examples:
        >>> @register_function
        ... def scale(t, k): t *= k
        >>> register_function("scale2", lambda t: t * 2)
    """
    if callable(name_or_fn) and fn is None:
        fn, name = name_or_fn, getattr(name_or_fn, "__qualname__", None)
    elif fn is None:
        return lambda f: register_function(name_or_fn, f)
    else:
        name = name_or_fn
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name must be an identifier-like string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    old = _FUNCTIONS.get(name)
    if old is not None and old is not fn:
        raise ValueError(f"a different function is already registered as {name!r}")
    _FUNCTIONS[name] = fn
    _NAMES[id(fn)] = name
    return fn


def name_of(fn):
    """The registered name for ``fn`` (a name or a registered function)."""
    if isinstance(fn, str):
        if fn not in _FUNCTIONS:
            raise ValueError(f"no function is registered as {fn!r} (register_function it on "
                             "every rank before init_master_worker)")
        return fn
    name = _NAMES.get(id(fn))
    if name is None or _FUNCTIONS.get(name) is not fn:
        raise ValueError(f"{fn!r} is not registered: register_function it on every rank "
                         "before init_master_worker (functions are called by name only)")
    return name


def lookup(name):
    fn = _FUNCTIONS.get(name)
    if fn is None:
        raise LookupError(f"no function is registered as {name!r} on this node")
    return fn


_MODULES = {}  # name -> nn.Module subclass


def register_module(cls):
    """Let workers build modules of class ``cls`` (a ``torch.nn.Module`` subclass) for
    ``to_node``; usable as a decorator. Call it on every rank before init_master_worker
    (module level does that): the worker builds the module from its own copy of the
    class, by name.

    Example:
        >>> @register_module
        ... class Net(torch.nn.Module): ...
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    name = f"module:{cls.__module__}.{cls.__qualname__}"
    old = _MODULES.get(name)
    if old is not None and old is not cls:
        raise ValueError(f"a different class is already registered as {name!r}")
    _MODULES[name] = cls
    return cls


def module_name(cls):
    name = f"module:{cls.__module__}.{cls.__qualname__}"
    return name if _MODULES.get(name) is cls else None


def module_class(name):
    return _MODULES.get(name)
