"""Master-worker mode: the master trains a linear model whose parameters live on two workers.

The feature columns and the weights are split between worker nodes 0 and 1 (model
parallel). Each step, each node computes its partial prediction, the two nodes add them
with an all_reduce between themselves (not through the master), and each node updates
its own half of the weights. The master only issues commands; it copies back the loss
every few steps and the weights at the end. Runs with NumPy alone (no torch needed):

    collectives-run -n 3 examples/master_worker_train.py
"""
import argparse

import numpy as np

import collectives as dist
import collectives.master_worker as mw


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_master_worker(backend="tcp")  # rank 0 goes on; ranks 1 and 2 serve it
    assert mw.num_nodes() >= 2, "run with at least 3 ranks (a master and two workers)"

    rng = np.random.default_rng(0)
    n, d = args.samples, args.features
    x = rng.standard_normal((n, d)).astype(np.float32)
    w_true = rng.standard_normal((d, 1)).astype(np.float32)
    y = x @ w_true + 0.01 * rng.standard_normal((n, 1)).astype(np.float32)

    half = d // 2
    cols = [slice(0, half), slice(half, d)]
    # each node gets its columns of the data, the targets, and its half of the weights
    xs = [mw.send(x[:, c], node=k) for k, c in enumerate(cols)]
    ys = [mw.send(y, node=k) for k in range(2)]
    ws = [mw.zeros(c.stop - c.start, 1, node=k) for k, c in enumerate(cols)]

    for step in range(args.steps):
        preds = [xs[k] @ ws[k] for k in range(2)]   # queued on each node
        mw.all_reduce(preds)                         # worker to worker: full predictions
        resid = [preds[k] - ys[k] for k in range(2)]
        for k in range(2):
            grad = xs[k].t() @ resid[k]
            ws[k] -= grad * (args.lr / n)            # in place, on the node
        if step % 50 == 0 or step == args.steps - 1:
            loss = (resid[0] * resid[0]).mean().item()  # a sync point: copies one number back
            print(f"step {step:4d}  loss {loss:.6f}", flush=True)

    w = np.concatenate([ws[0].numpy(), ws[1].numpy()])
    err = float(np.abs(w - w_true).max())
    print(f"max |w - w_true| = {err:.4f}")
    assert err < 0.05, "training did not converge"


if __name__ == "__main__":
    main()
