"""The mapped all_reduce against the usual one, on the same sizes in the same job.

Run under the launcher, one job per world::

    collectives-run -n 2 bench/mapped_all_reduce.py [--sizes-mib 1,4,16,64] [--reps 30]
        [--json out.jsonl]

Each size: a float32 torch tensor moved into shared memory and mapped by every rank
(collectives.torch_bridge.mapped, as DDP's buckets are), and a plain one of the same size
(the engine's own choice: two-shot through the segment or the single copy, after its
trials); the two alternate call by call, and the in-place multiply by one (the least
memory traffic an all_reduce of the buffer can do: read it once, write it once) runs
beside them. Median of the timed calls after a warm-up of 15 (the engine's trials).
Rank 0 prints one line per size and, with ``--json``, appends one record per size.
"""
import argparse
import json
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import torch

    import collectives as dist
    from collectives.torch_bridge import mapped
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = group.backend
    for mib in (float(s) for s in a.sizes_mib.split(",")):
        n = int(mib * 2 ** 20) // 4
        shared, plain = torch.ones(n), torch.ones(n)
        if not mapped.register(shared, group):
            raise SystemExit("the buffer could not be mapped on every rank")
        times = {"mapped": [], "plain": [], "mul": []}
        before = backend.mapped_calls
        for _ in range(15 + a.reps):
            for which, t in (("mapped", shared), ("plain", plain)):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times[which].append(time.perf_counter() - t0)
                t.fill_(1.0)
            t0 = time.perf_counter()
            plain.mul_(1.0)
            times["mul"].append(time.perf_counter() - t0)
        took = backend.mapped_calls - before
        med = {k: 1e3 * statistics.median(v[15:]) for k, v in times.items()}
        if rank == 0:
            print(f"world {world} {mib:g} MiB: mapped {med['mapped']:.3f} ms, usual "
                  f"{med['plain']:.3f} ms ({med['mapped'] / med['plain']:.2f}x), in-place "
                  f"multiply {med['mul']:.3f} ms; mapped calls {took}", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps({"world": world, "mib": mib, "mapped_ms": med["mapped"],
                                        "usual_ms": med["plain"], "mul_ms": med["mul"],
                                        "mapped_calls": took, "reps": a.reps}) + "\n")
        del shared, plain  # (its registration ends with it)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
