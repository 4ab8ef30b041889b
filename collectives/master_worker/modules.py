"""torch modules and optimizers that live on a worker node (torch mode).

``mw.to_node(module, k)`` copies a module to node ``k`` by its structure, not by pickle:
for the module and each submodule, its class's name, its plain attributes (numbers, str,
bools, tuples, dtypes...) and its parameters and buffers by value. The worker builds the
module from that: the class must be one of ``torch.nn``'s module classes or one registered
with :func:`register_module` on every rank before ``init_master_worker`` (its code is the
worker's own copy of the program; nothing travels that runs). The returned
:class:`RemoteModule` runs its forward pass on the node; its ``parameters()`` are remote
tensors.

``mw.optim(torch.optim.SGD, params, lr=0.1)`` makes a ``torch.optim`` optimizer on the
node of ``params``; ``step()`` and ``zero_grad()`` are queued commands.
"""
import collectives.master_worker.remote_call as dispatch
import collectives.master_worker.protocol as P
from .master import get_master
from .nn_worker import optimizer_classes
from .registry import module_name

_BASE_KEYS = None


def _base_keys():
    global _BASE_KEYS
    if _BASE_KEYS is None:
        import torch
        _BASE_KEYS = frozenset(vars(torch.nn.Module()))
    return _BASE_KEYS


# ---- the master's side -----------------------------------------------------------------------
def class_name(cls):
    """The name a module class travels by; ValueError when workers may not build it."""
    import torch
    if getattr(torch.nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    name = module_name(cls)
    if name is None:
        raise ValueError(f"{cls.__module__}.{cls.__qualname__} is not a torch.nn module class: "
                         "register it with collectives.master_worker.register_module on every "
                         "rank before init_master_worker")
    return name


def _value(t):
    from .codec import TensorValue
    import numpy as np
    src = t.detach().cpu().contiguous()
    dt = str(src.dtype)[6:]
    import torch
    arr = src.view(torch.int16).numpy().view(np.uint16) if dt == "bfloat16" else src.numpy()
    return TensorValue(arr.copy(), dt, bool(t.requires_grad))


def describe(mod, path="module", seen=None):
    """The plain-data description a worker builds ``mod`` from."""
    seen = {} if seen is None else seen
    attrs = {}
    w = dispatch._Where()
    for k, v in vars(mod).items():
        if k in _base_keys():
            continue
        try:
            attrs[k] = dispatch._conv(v, w, f"{path}.{k}")
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}.{k} cannot be sent to a worker ({e}); only modules whose "
                             "attributes are plain data can be built on a node") from None
        if w.nd is not None:
            raise ValueError(f"{path}.{k} is a remote tensor: a module to send holds local data")
    params = {}
    for k, p in mod._parameters.items():
        if p is not None:
            if id(p) in seen:
                raise ValueError(f"{path}.{k} is the same parameter as {seen[id(p)]}: tied "
                                 "parameters are not supported on nodes")
            seen[id(p)] = f"{path}.{k}"
        params[k] = None if p is None else _value(p)
    buffers = {k: None if b is None else _value(b) for k, b in mod._buffers.items()}
    children = {k: None if c is None else describe(c, f"{path}.{k}", seen)
                for k, c in mod._modules.items()}
    return {"cls": class_name(type(mod)), "attrs": attrs, "params": params,
            "buffers": buffers, "children": children, "training": bool(mod.training),
            "non_persistent": sorted(mod._non_persistent_buffers_set)}


class RemoteModule:
    """A torch module on a worker node: calling it runs ``forward`` there (queued, on
    remote inputs); ``parameters()`` are remote tensors on that node."""

    def __init__(self, handle, names, params, cls):
        self._h = handle
        self._mw_key = ("module", handle._hid)
        self._names = names
        self._params = params
        self._cls = cls

    @property
    def _mw_ref(self):
        return self._h

    def get_node(self):
        return self._h.get_node()

    def __call__(self, *args, **kwargs):
        return _run("collectives.Module.__call__", (self,) + args, kwargs)

    forward = __call__

    def parameters(self, recurse=True):
        return iter(self._params)

    def named_parameters(self):
        return iter(list(zip(self._names, self._params)))

    def train(self, mode=True):
        _run("collectives.Module.train", (self, bool(mode)), None)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none=True):
        _run("collectives.Module.zero_grad", (self, bool(set_to_none)), None)

    def state_dict(self):
        """A local copy of the module's state (a sync point): name -> torch tensor."""
        sd = _run("collectives.Module.state_dict", (self,), None)
        return {k: v.get() for k, v in sd.items()}

    def load_state_dict(self, state_dict):
        """Copy local tensors into the node's module (queued)."""
        _run("collectives.Module.load_state_dict", (self, dict(state_dict)), None)

    def __repr__(self):
        return f"RemoteModule({self._cls}, node={self.get_node()})"


class RemoteOptimizer:
    """A ``torch.optim`` optimizer on a worker node; ``step()``/``zero_grad()`` are queued."""

    def __init__(self, handle, cls):
        self._h = handle
        self._mw_key = ("optimizer", cls)
        self._cls = cls

    @property
    def _mw_ref(self):
        return self._h

    def step(self):
        _run("collectives.Optimizer.step", (self,), None)

    def zero_grad(self, set_to_none=True):
        _run("collectives.Optimizer.zero_grad", (self, bool(set_to_none)), None)

    def __repr__(self):
        return f"RemoteOptimizer({self._cls}, node={self._h.get_node()})"


dispatch.KEYED.update((RemoteModule, RemoteOptimizer))


def _run(name, args, kwargs):
    m = get_master()
    return dispatch.call_entry(m, dispatch.entry_of(m, name), args, kwargs)


def _torch_master():
    m = get_master()
    if m.torch is None:
        raise ValueError("modules and optimizers on nodes need torch on the workers "
                         "(library='torch', or import torch before init_master_worker)")
    return m


def to_node(module, node):
    """Copy the torch module ``module`` to worker ``node``: a :class:`RemoteModule`.

    Example:
        >>> net = mw.to_node(torch.nn.Linear(4, 2), 1)
        >>> y = net(mw.randn(8, 4, node=1))
    """
    m = _torch_master()
    import torch
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    nd = m.node(node)
    desc = describe(module)
    names = [n for n, _ in module.named_parameters()]
    from .tensor import RemoteTensor
    m.usable(nd)
    hids = [m.new_hid(nd) for _ in range(len(names) + 1)]
    m.command(nd, P.C_CALL, ("collectives.module", hids, (desc,), None))
    handle = RemoteTensor(m, nd, hids[0])
    params = [RemoteTensor(m, nd, h) for h in hids[1:]]
    return RemoteModule(handle, names, params, desc["cls"])


def optim(cls, params, **kwargs):
    """A ``torch.optim`` optimizer of class ``cls`` over remote ``params`` (all on one
    node), made on that node: a :class:`RemoteOptimizer`.

    Example:
        >>> opt = mw.optim(torch.optim.SGD, net.parameters(), lr=0.1)
        >>> opt.zero_grad(); loss.backward(); opt.step()
    """
    m = _torch_master()
    import torch
    if isinstance(cls, str):
        name = cls
    elif isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        name = f"torch.optim.{cls.__name__}"
    else:
        raise TypeError(f"cls must be a torch.optim optimizer class, got {cls!r}")
    if name not in optimizer_classes():
        raise ValueError(f"{name} is not a torch.optim optimizer class workers may build")
    params = list(params)
    if not params:
        raise ValueError("params is empty: an optimizer needs parameters")
    w = dispatch._Where()
    p = dispatch._conv(params, w, "params")
    k = {n: dispatch._conv(v, w, f"argument {n!r}") for n, v in kwargs.items()}
    if w.nd is None:
        raise ValueError("params must be remote tensors (e.g. a RemoteModule's parameters())")
    from .tensor import RemoteTensor
    nd = w.nd
    hid = m.new_hid(nd)
    m.command(nd, P.C_CALL, ("collectives.optimizer", [hid], (name, p, k), None))
    return RemoteOptimizer(RemoteTensor(m, nd, hid), name)
