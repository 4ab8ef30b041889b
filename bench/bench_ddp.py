#!/usr/bin/env python3
"""DistributedDataParallel training steps: torch.distributed's gloo against collectives.

    python bench/bench_ddp.py                                  # worlds 2 and 4, two model sizes
    python bench/bench_ddp.py --worlds 2 --widths 1024 --rounds 3 --markdown

The same program trains the same model with ``torch.nn.parallel.DistributedDataParallel``
in both: ``torch:gloo`` calls ``torch.distributed.init_process_group("gloo")``,
``collectives:gloo`` calls ``collectives.init_process_group("gloo")`` (torch's default
group then runs on collectives, see collectives/torch_bridge/torch_pg.py). The model is an MLP of
``--depth`` Linear+ReLU layers of ``--widths`` features (float32), batch ``--batch`` per
rank, SGD. Each rank first times the steps without DDP (``local``: the compute alone,
under the same load from the other ranks), then with DDP; rank 0 reports the median
step time over ``--steps`` steps after ``--warmup``. Every round launches each
implementation once, in turn, so drift hits both alike; the table gives the median over
rounds, and the ratio collectives/torch (below 1: collectives faster).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import torch_ranks  # noqa: E402
IMPLS = ["torch:gloo", "collectives:gloo"]


def worker():
    import torch
    impl, width, depth = os.environ["IMPL"], int(os.environ["WIDTH"]), int(os.environ["DEPTH"])
    steps, warmup, batch = int(os.environ["STEPS"]), int(os.environ["WARMUP"]), int(os.environ["BATCH"])
    if impl == "torch:gloo":
        import torch.distributed as dist
    else:
        import collectives as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(batch, width)

    def timed(m):
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        times = []
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[warmup:]) * 1e3

    local = timed(model)
    ddp = timed(torch.nn.parallel.DistributedDataParallel(model))
    if rank == 0:
        print("RESULT " + json.dumps({"local_ms": local, "ddp_ms": ddp,
                                      "params": sum(p.numel() for p in model.parameters())}),
              flush=True)
    dist.barrier()  # torch gloo can abort ("terminate called...") when a peer leaves first
    dist.destroy_process_group()


def launch(impl, world, width, a):
    return torch_ranks.launch(__file__, world, dict(
        IMPL=impl, WIDTH=str(width), DEPTH=str(a.depth), STEPS=str(a.steps),
        WARMUP=str(a.warmup), BATCH=str(a.batch)), a.timeout, f"{impl} world {world} width {width}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--widths", default="256,1024")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:
        return worker()
    impls = a.impls.split(",")
    for impl in impls:
        if impl not in IMPLS:
            ap.error(f"--impls: unknown {impl!r}; choose from {', '.join(IMPLS)}")
    rows = []
    for world in [int(w) for w in a.worlds.split(",")]:
        for width in [int(w) for w in a.widths.split(",")]:
            res = {impl: [] for impl in impls}
            for rnd in range(a.rounds):
                order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
                for impl in order:
                    res[impl].append(launch(impl, world, width, a))
                    print(f"# world={world} width={width} round={rnd + 1} {impl}: "
                          f"{res[impl][-1]['ddp_ms']:.2f} ms/step", file=sys.stderr, flush=True)
            rows.append((world, width, res))
    head = ["world", "params", "local ms"] + [f"{i} DDP ms" for i in impls]
    if "torch:gloo" in impls and "collectives:gloo" in impls:
        head.append("collectives/torch")
    print(("| " + " | ".join(head) + " |") if a.markdown else "  ".join(f"{h:>18}" for h in head))
    if a.markdown:
        print("|" + "---:|" * len(head))
    for world, _width, res in rows:
        first = res[impls[0]][0]
        local = statistics.median(r["local_ms"] for rs in res.values() for r in rs)
        ddp = {i: statistics.median(r["ddp_ms"] for r in res[i]) for i in impls}
        cells = [str(world), f"{first['params'] / 1e6:.2f}M", f"{local:.2f}"]
        cells += [f"{ddp[i]:.2f}" for i in impls]
        if len(head) > len(cells):
            cells.append(f"{ddp['collectives:gloo'] / ddp['torch:gloo']:.2f}")
        print(("| " + " | ".join(cells) + " |") if a.markdown else "  ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
