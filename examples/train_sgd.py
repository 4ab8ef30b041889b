"""Synchronous SGD with gradient averaging: the torch.distributed tutorial's program.

Only the import differs from the torch.distributed version. Run it on 4 local ranks:

    collectives-run -n 4 examples/train_sgd.py
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives as dist  # was: import torch.distributed as dist


def make_data(rank, world, n=4096, dim=32, classes=4):
    """A fixed synthetic classification set, partitioned across ranks."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    part = n // world
    return x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]


def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    x, y = make_data(rank, world)
    bsz = max(1, args.batch // world)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        epoch_loss = 0.0
        batches = 0
        for i in range(0, len(x), bsz):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[i:i + bsz]), y[i:i + bsz])
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            opt.step()
            batches += 1
        print(f"rank {rank} epoch {epoch} loss {epoch_loss / batches:.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum().item()
    print(f"rank {rank} done in {elapsed:.2f} s, parameter checksum {checksum:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
