"""The worker's side of modules and optimizers on a node (torch mode): the
``collectives.*`` entries of a torch worker's allow-list (see modules.py for the
master's side and what travels)."""
from .allow import PACKAGE_FUNCTION_NAMES, Entry
from .registry import module_class


def torch_module_classes():
    import torch
    return {f"torch.nn.{n}": c for n, c in vars(torch.nn).items()
            if isinstance(c, type) and issubclass(c, torch.nn.Module)}


def optimizer_classes():
    import torch
    return {f"torch.optim.{n}": c for n, c in vars(torch.optim).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
            and c is not torch.optim.Optimizer}


def worker_entries():
    """The ``collectives.*`` names a torch worker runs: build modules and optimizers, and
    the few methods of them the master calls."""
    import torch
    nn = torch.nn

    def build(desc):
        name = desc["cls"]
        cls = torch_module_classes().get(name) or module_class(name)
        if cls is None:
            raise ValueError(f"{name} is neither a torch.nn module class nor registered on "
                             "this worker (register_module before init_master_worker)")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        for k, v in desc["attrs"].items():
            mod.__dict__[k] = v
        for k, p in desc["params"].items():
            mod._parameters[k] = None if p is None else nn.Parameter(
                p.detach(), requires_grad=p.requires_grad)
        for k, b in desc["buffers"].items():
            mod._buffers[k] = b
        mod._non_persistent_buffers_set = set(desc["non_persistent"])
        for k, c in desc["children"].items():
            mod._modules[k] = None if c is None else build(c)
        mod.training = desc["training"]
        return mod

    def module(desc):
        mod = build(desc)
        return (mod,) + tuple(p for _, p in mod.named_parameters())

    def optimizer(name, params, kwargs):
        cls = optimizer_classes().get(name)
        if cls is None:
            raise ValueError(f"{name} is not a torch.optim optimizer class")
        return (cls(params, **kwargs),)

    def is_module(x):
        if not isinstance(x, nn.Module):
            raise TypeError(f"expected a module on this node, got {type(x).__name__}")
        return x

    def is_optimizer(x):
        if not isinstance(x, torch.optim.Optimizer):
            raise TypeError(f"expected an optimizer on this node, got {type(x).__name__}")
        return x

    fns = {
        "collectives.module": module,
        "collectives.optimizer": optimizer,
        "collectives.Module.__call__": lambda mod, *a, **k: is_module(mod)(*a, **k),
        "collectives.Module.train": lambda mod, mode: (is_module(mod).train(mode), None)[1],
        "collectives.Module.zero_grad": lambda mod, s: is_module(mod).zero_grad(s),
        "collectives.Module.state_dict": lambda mod: dict(is_module(mod).state_dict()),
        "collectives.Module.load_state_dict":
            lambda mod, sd: (is_module(mod).load_state_dict(sd), None)[1],
        "collectives.Optimizer.step": lambda opt: is_optimizer(opt).step(),
        "collectives.Optimizer.zero_grad": lambda opt, s: is_optimizer(opt).zero_grad(s),
    }
    assert set(fns) == set(PACKAGE_FUNCTION_NAMES)
    return {k: Entry(k, f) for k, f in fns.items()}
