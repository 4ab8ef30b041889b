"""collectives without torch: all_reduce, broadcast and all_gather on NumPy arrays.

    collectives-run -n 4 examples/numpy_allreduce.py
"""
import numpy as np

import collectives as dist


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = np.full(5, rank + 1, dtype=np.float64)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    assert np.all(x == world * (world + 1) / 2), x
    b = np.arange(3, dtype=np.int32) if rank == 0 else np.zeros(3, np.int32)
    dist.broadcast(b, src=0)
    out = np.zeros(world, np.int64)
    dist.all_gather_into_tensor(out, np.array([rank * 10], np.int64))
    print(f"rank {rank}: all_reduce {x[0]:g}, broadcast {b.tolist()}, all_gather {out.tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
