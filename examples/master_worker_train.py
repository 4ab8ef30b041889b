"""Master-worker mode: the master trains a torch nn.Module with an optimizer on two workers.

Data parallel across worker nodes 0 and 1: each node holds a copy of the module
(``mw.to_node``), an SGD optimizer over its parameters (``mw.optim``) and half of the
data. Each step, each node runs forward, backward and ``step()`` on its half; then the
two nodes average their parameters with an ``all_reduce`` between themselves (not through
the master). With plain SGD that is exactly full-batch training: the script trains the
same module locally alongside and checks that the two agree. The master only issues
commands; it copies back the loss every few steps and the parameters at the end.

    collectives-run -n 3 examples/master_worker_train.py
"""
import argparse

import torch
import torch.nn.functional as F

import collectives as dist
import collectives.master_worker as mw


def make_model(features, hidden):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_master_worker(backend="tcp")  # rank 0 goes on; ranks 1 and 2 serve it
    assert mw.num_nodes() >= 2, "run with at least 3 ranks (a master and two workers)"

    g = torch.Generator().manual_seed(1)
    n, d = args.samples, args.features
    x = torch.randn(n, d, generator=g)
    w_true = torch.randn(d, 1, generator=g) / d ** 0.5
    y = torch.tanh(x @ w_true) + 0.01 * torch.randn(n, 1, generator=g)
    halves = [slice(0, n // 2), slice(n // 2, n)]

    # each node: a copy of the model, its optimizer, its half of the data
    nets = [mw.to_node(make_model(d, args.hidden), k) for k in range(2)]
    opts = [mw.optim(torch.optim.SGD, nets[k].parameters(), lr=args.lr) for k in range(2)]
    xs = [mw.send(x[h], node=k) for k, h in enumerate(halves)]
    ys = [mw.send(y[h], node=k) for k, h in enumerate(halves)]

    local = make_model(d, args.hidden)  # the same training, here, for comparison
    local_opt = torch.optim.SGD(local.parameters(), lr=args.lr)

    for step in range(args.steps):
        losses = []
        for k in range(2):                          # queued on each node
            opts[k].zero_grad()
            loss = F.mse_loss(nets[k](xs[k]), ys[k])
            loss.backward()
            opts[k].step()
            losses.append(loss)
        for p0, p1 in zip(nets[0].parameters(), nets[1].parameters()):
            mw.all_reduce([p0, p1])                 # worker to worker
            with torch.no_grad():                   # covers the nodes' next commands
                p0.div_(2)
                p1.div_(2)
        local_opt.zero_grad()
        F.mse_loss(local(x), y).backward()
        local_opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            loss = (losses[0].item() + losses[1].item()) / 2  # a sync point: two numbers back
            print(f"step {step:4d}  loss {loss:.6f}", flush=True)

    remote = nets[0].state_dict()                    # copies back
    diff = max(float((remote[k] - v).abs().max()) for k, v in local.state_dict().items())
    final = F.mse_loss(local(x), y).item()
    print(f"final loss {final:.6f}; max |node params - local params| = {diff:.2e}")
    assert diff < 1e-4, "the nodes' training differs from local training"
    assert final < 0.7 * F.mse_loss(make_model(d, args.hidden)(x), y).item(), "did not train"


if __name__ == "__main__":
    main()
