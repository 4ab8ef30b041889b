"""Programs the elastic tests start as plain processes (one per rank, no launcher unless
a test says so). Each reads its part from ELASTIC_* variables and writes one JSON line of
results to ELASTIC_OUT/<pid>.json when it finishes."""
import json
import os
import signal
import socket
import time

import numpy as np

DIM = 8
BATCH = 12  # samples per step, split over the members


def grad_of(ids, w, step):
    """The summed gradient of samples ``ids``: small integers, so that any split of the
    batch over any world sums to the same float64 bits."""
    g = np.zeros(DIM)
    for i in ids:
        g += ((i * 7 + step + np.arange(DIM)) % 5 - 2) + (np.abs(w) % 3 == 0)
    return g


def reference(steps):
    """The fault-free result: every step's whole batch on one process."""
    w = np.zeros(DIM)
    for step in range(steps):
        w = w - grad_of(range(step * BATCH, (step + 1) * BATCH), w, step)
    return w


def members_log(out):
    """The lines the programs append to ``out``/members.log (one per process and
    generation: gen, rank, world, pid, host, t), as dicts."""
    path = os.path.join(out, "members.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_until(pred, what, timeout=60):
    """``pred()``'s first true value, looked at every 0.1 s; AssertionError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _kill_now():
    os.kill(os.getpid(), signal.SIGKILL)


def _join_after():
    """ELASTIC_JOIN_AFTER=g: a newcomer, started early (imports done), that calls
    elastic.init once generation g is decided."""
    g = os.environ.get("ELASTIC_JOIN_AFTER")
    if g is None:
        return
    from collectives.store.failover import FailoverStore
    store = FailoverStore(os.environ["COLLECTIVES_ELASTIC_STORE"])
    deadline = time.monotonic() + 60
    while not store.check([f"elastic/job/gen/{g}"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    store.close()


def numpy_worker():
    """ObjectState training: kill the process of rank ELASTIC_VICTIM of generation 0 at
    step ELASTIC_KILL_STEP (before its all_reduce), if set."""
    import collectives as dist
    from collectives import elastic

    steps = int(os.environ.get("ELASTIC_STEPS", "20"))
    victim = int(os.environ.get("ELASTIC_VICTIM", "-1"))
    kill_step = int(os.environ.get("ELASTIC_KILL_STEP", "-1"))
    step_sleep = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
    _join_after()
    elastic.init(timeout=float(os.environ.get("ELASTIC_TIMEOUT", "20")))
    newcomer = elastic.generation() > 0
    state = elastic.ObjectState(step=0, w=np.zeros(DIM))
    seen = []

    @elastic.run
    def train(state):
        with open(os.path.join(os.environ["ELASTIC_OUT"], "members.log"), "a") as f:
            f.write(json.dumps({"gen": elastic.generation(), "rank": dist.get_rank(),
                                "world": dist.get_world_size(), "pid": os.getpid(),
                                "host": socket.gethostname(), "t": time.time()}) + "\n")
        for step in range(state.step, steps):
            rank, world = dist.get_rank(), dist.get_world_size()
            seen.append((elastic.generation(), world))
            if step == kill_step and elastic.generation() == 0 and rank == victim:
                _kill_now()
            ids = range(step * BATCH + rank, (step + 1) * BATCH, world)
            g = grad_of(ids, state.w, step)
            dist.all_reduce(g)
            state.w = state.w - g
            state.step = step + 1
            if step_sleep:
                time.sleep(step_sleep)
            state.commit()

    train(state)
    out = {"pid": os.getpid(), "w": state.w.tobytes().hex(), "step": state.step,
           "rank": dist.get_rank(), "world": dist.get_world_size(),
           "gen": elastic.generation(), "resets": elastic.resets(), "newcomer": newcomer,
           "worlds": sorted(set(seen))}
    with open(os.path.join(os.environ["ELASTIC_OUT"], f"{os.getpid()}.json"), "w") as f:
        json.dump(out, f)
    elastic.shutdown()


def torch_reference(steps):
    """The DDP recipe's fault-free result: every step's whole batch on one process."""
    model, opt = _torch_model()
    for step in range(steps):
        opt.zero_grad()
        _torch_loss(model, range(step * BATCH, (step + 1) * BATCH), 1).backward()
        opt.step()
    return model.weight.detach().numpy().tobytes().hex()


def _torch_model():
    import torch
    model = torch.nn.Linear(DIM, 1, bias=False).double()
    with torch.no_grad():
        model.weight.zero_()
    # momentum: the optimizer's state matters, and travels in sync()
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)


def _torch_loss(model, ids, world, rank=0):
    """world * (a linear data term over ``ids``, plus |w|^2 / 2 on rank 0): DDP divides
    each rank's gradient by the world before summing, so each is a multiple of the world
    and the step's gradient is the batch's integer sum plus w, whatever the split (every
    quantity a binary fraction, every operation exact)."""
    import torch
    ids = list(ids)
    x = torch.tensor([[(i * 3 + j) % 7 - 3 for j in range(DIM)] for i in ids],
                     dtype=torch.float64)
    c = torch.tensor([[(i % 5) - 2] for i in ids], dtype=torch.float64)
    w = model.module.weight if hasattr(model, "module") else model.weight
    return world * ((model(x) * c).sum() + (0.5 * (w * w).sum() if rank == 0 else 0.0))


def ddp_worker():
    """The DDP recipe (docs/elastic.md): TorchState(model, optimizer), DDP rebuilt on the
    new default group by a reset callback, torch's DistributedSampler split following it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    import collectives as dist
    from collectives import elastic

    steps = int(os.environ.get("ELASTIC_STEPS", "20"))
    victim = int(os.environ.get("ELASTIC_VICTIM", "-1"))
    kill_step = int(os.environ.get("ELASTIC_KILL_STEP", "-1"))
    elastic.init(timeout=float(os.environ.get("ELASTIC_TIMEOUT", "20")))
    newcomer = elastic.generation() > 0
    model, opt = _torch_model()
    state = elastic.TorchState(model, opt, step=0)
    ddp = {"model": DDP(model), "built_on": [elastic.generation()]}
    checks = []

    def rebuild():  # after a reset: DDP over the new default group
        ddp["model"] = DDP(model)
        ddp["built_on"].append(elastic.generation())

    state.register_reset_callbacks([rebuild])

    @elastic.run
    def train(state):
        for step in range(state.step, steps):
            rank, world = dist.get_rank(), dist.get_world_size()
            if step == kill_step and elastic.generation() == 0 and rank == victim:
                _kill_now()
            sampler = DistributedSampler(range(BATCH), shuffle=False)  # torch's, our group
            checks.append((sampler.num_replicas == world, sampler.rank == rank,
                           torch.distributed.get_world_size() == world))
            opt.zero_grad()
            _torch_loss(ddp["model"], (step * BATCH + i for i in sampler), world,
                        rank).backward()
            opt.step()
            state.step = step + 1
            state.commit()

    train(state)
    out = {"pid": os.getpid(), "w": model.weight.detach().numpy().tobytes().hex(),
           "step": state.step, "rank": dist.get_rank(), "world": dist.get_world_size(),
           "gen": elastic.generation(), "resets": elastic.resets(), "newcomer": newcomer,
           "built_on": ddp["built_on"], "checks_ok": all(all(c) for c in checks),
           "momentum": opt.state_dict()["state"][0]["momentum_buffer"].numpy().tobytes().hex()}
    with open(os.path.join(os.environ["ELASTIC_OUT"], f"{os.getpid()}.json"), "w") as f:
        json.dump(out, f)
    elastic.shutdown()


if __name__ == "__main__":
    if os.environ.get("ELASTIC_DEBUG_AFTER"):  # a hung test's stacks, on its output
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["ELASTIC_DEBUG_AFTER"]), exit=True)
    globals()[os.environ.get("ELASTIC_PROGRAM", "numpy_worker")]()
