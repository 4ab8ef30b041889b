"""Programs the elastic tests start as plain processes (one per rank, no launcher unless
a test says so). Each reads its part from ELASTIC_* variables and writes one JSON line of
results to ELASTIC_OUT/<pid>.json when it finishes."""
import json
import os
import signal
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


def _kill_now():
    os.kill(os.getpid(), signal.SIGKILL)


def numpy_worker():
    """ObjectState training: kill the process of rank ELASTIC_VICTIM of generation 0 at
    step ELASTIC_KILL_STEP (before its all_reduce), if set."""
    import collectives as dist
    from collectives import elastic

    steps = int(os.environ.get("ELASTIC_STEPS", "20"))
    victim = int(os.environ.get("ELASTIC_VICTIM", "-1"))
    kill_step = int(os.environ.get("ELASTIC_KILL_STEP", "-1"))
    step_sleep = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
    elastic.init(timeout=float(os.environ.get("ELASTIC_TIMEOUT", "20")))
    newcomer = elastic.generation() > 0
    state = elastic.ObjectState(step=0, w=np.zeros(DIM))
    seen = []

    @elastic.run
    def train(state):
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


if __name__ == "__main__":
    globals()[os.environ.get("ELASTIC_PROGRAM", "numpy_worker")]()
