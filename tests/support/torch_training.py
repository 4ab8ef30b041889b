"""Training cases the torch bridge's tests run on every rank of a pool, and the
single-process reference they are checked against (test_torch_pg's DDP and FSDP
properties, test_fsdp_shared, test_timeline)."""


def bridged():
    """Run on a rank of a pool: torch's default group over collectives' default group
    (installed here when the pool's init ran before torch was imported)."""
    import torch.distributed as td

    import collectives as dist
    import collectives.torch_bridge.torch_pg as tp
    if not td.is_initialized():
        assert tp.install_default(dist.group.WORLD)
    assert td.get_backend() == "collectives"
    return td


def model_of(width, seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.BatchNorm1d(width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 2))


def batch(case, rank, step, micro):
    import torch

    g = torch.Generator().manual_seed(case["seed"] * 1000 + rank * 100 + step * 10 + micro)
    x = torch.randn(case["batch"], 3, generator=g, dtype=torch.float64)
    y = torch.randn(case["batch"], 2, generator=g, dtype=torch.float64)
    return x, y


def ddp_reference(case, ranks):
    """One process training on the data of ``ranks`` (global ranks), from the first one's
    initial parameters."""
    import torch

    model = model_of(case["width"], case["seed"] + ranks[0]).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(case["steps"]):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in ranks:
            model.zero_grad()
            for micro in range(case["accumulate"]):
                x, y = batch(case, r, step, micro)
                torch.nn.functional.mse_loss(model(x), y).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad / len(ranks)
        for g, p in zip(grads, model.parameters()):
            p.grad = g
        opt.step()
    return [p.detach().numpy() for p in model.parameters()]


def fsdp_case(ctx, case):
    """Run on every rank: train with FSDP; this rank's full parameters after training.
    Flavours: ``fsdp1`` (torch's FullyShardedDataParallel on the CPU); ``fully_shard`` a
    layer at a time and the model, as a program writes it (on our groups FSDP2's calls go
    through shared memory from the first forward: checked); ``fully_shard_own`` the model
    with FSDP2's own calls (``keep_fsdp_defaults``); ``fully_shard_shared`` a layer at a
    time with ``share_collectives`` (``slots``, ``shared_rs``)."""
    import torch

    bridged()
    model = model_of(case["width"], case["seed"] + ctx.rank).double()
    with torch.no_grad():  # start from rank 0's (FSDP's sync_module_states wants a GPU)
        for p in model.parameters():
            torch.distributed.broadcast(p, 0)
    flavor = case["flavor"]
    if flavor == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        from torch.distributed.fsdp import fully_shard

        from collectives.torch_bridge import fsdp
        if flavor != "fully_shard_own":  # a param group a layer: several buffers alive
            for m in model:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m)
        wrapped = fully_shard(model)
        if flavor == "fully_shard_own":
            fsdp.keep_fsdp_defaults(wrapped)
        elif flavor == "fully_shard_shared":
            gather, scatter = fsdp.share_collectives(wrapped, slots=case["slots"],
                                                     reduce_scatter=case["shared_rs"])
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(case["steps"]):
        opt.zero_grad()
        for micro in range(case["accumulate"]):
            x, y = batch(case, ctx.rank, step, micro)
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
    if flavor == "fsdp1":
        with FSDP.summon_full_params(wrapped):
            return [p.detach().clone().numpy() for p in wrapped.parameters()]
    comms = fsdp_comms(wrapped)
    kinds = {(type(g).__name__, type(s).__name__) for g, s in comms}
    if flavor == "fully_shard_own":
        assert kinds == {("DefaultAllGather", "DefaultReduceScatter")}, kinds
    elif ctx.world_size > 1:  # every call went through shared memory
        calls = case["steps"] * case["accumulate"]
        if flavor == "fully_shard":  # one pair for all the modules of the group
            assert kinds == {("SharedAllGather", "SharedReduceScatter")} and len(comms) == 1, comms
            gather, scatter = comms.pop()
        assert gather.shared_calls >= 2 * calls, gather.shared_calls
        assert scatter is None or scatter.shared_calls >= calls, scatter.shared_calls
    return [p.full_tensor().detach().numpy() for p in model.parameters()]


def fsdp_comms(model):
    """The (all_gather, reduce_scatter) objects of the FSDP2 modules in ``model`` that hold
    parameters, each pair once."""
    from torch.distributed.fsdp import FSDPModule
    return {(pg._all_gather_comm, pg._reduce_scatter_comm)
            for m in model.modules() if isinstance(m, FSDPModule)
            for pg in m._get_fsdp_state()._fsdp_param_groups}
