"""A rank of tests/store_launch/test_multinode.py's jobs: ``multinode_target.py MODE DIR``.

check: every collective and a ring of point-to-point messages, against a NumPy
    reference; prints one JSON line (host name, backend, mismatches).
partition: all_reduce until it raises (the test cuts the link between the nodes once
    every rank has written DIR/ready.RANK); prints one JSON line (what was raised, and
    how long after the last all_reduce that succeeded), and exits with code 3.
"""
import json
import os
import socket
import sys
import time
from datetime import timedelta

import numpy as np

import collectives as dist

GROUP_TIMEOUT = 4.0


def check():
    r, w = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(7)  # every rank draws every rank's data
    bad = []
    for it, n in enumerate([0, 1, 7, 1000, 65537, 1 << 19]):
        data = [rng.integers(-50, 50, n).astype(np.float64) for _ in range(w)]
        total = sum(data)
        root = (it * 3 + 1) % w

        def expect(name, ok, n=n, root=root):
            if not ok:
                bad.append(f"{name} n={n} root={root}")

        x = data[r].copy()
        dist.all_reduce(x)
        expect("all_reduce", np.array_equal(x, total))
        x = data[r].copy()
        dist.reduce(x, dst=root)
        expect("reduce", r != root or np.array_equal(x, total))
        expect("reduce leaves non-roots' inputs", r == root or np.array_equal(x, data[r]))
        x = data[r].copy()
        dist.broadcast(x, src=root)
        expect("broadcast", np.array_equal(x, data[root]))
        out = np.empty(n * w)
        dist.all_gather_into_tensor(out, data[r])
        expect("all_gather_into_tensor", np.array_equal(out, np.concatenate(data)))
        outs = [np.empty(n) for _ in range(w)]
        dist.all_gather(outs, data[r])
        expect("all_gather", all(np.array_equal(a, b) for a, b in zip(outs, data)))
        k = n // w
        part = np.empty(k)
        dist.reduce_scatter_tensor(part, np.ascontiguousarray(data[r][:k * w]))
        expect("reduce_scatter_tensor", np.array_equal(part, total[r * k:(r + 1) * k]))
        got = [np.empty(n) for _ in range(w)] if r == root else None
        dist.gather(data[r], got, dst=root)
        expect("gather", r != root or all(np.array_equal(a, b) for a, b in zip(got, data)))
        x = np.empty(n)
        dist.scatter(x, data if r == root else None, src=root)
        expect("scatter", np.array_equal(x, data[r]))
        x = np.empty(n * w)
        dist.all_to_all_single(x, np.concatenate([data[r] + q for q in range(w)]))
        expect("all_to_all_single", np.array_equal(x, np.concatenate([d + r for d in data])))
        dist.barrier()
        y = np.empty(n)
        req = dist.isend(data[r], (r + 1) % w)
        dist.recv(y, (r - 1) % w)
        req.wait()
        expect("send/recv", np.array_equal(y, data[(r - 1) % w]))
    be = dist.distributed_c10d._get_default_group().backend
    return {"rank": r, "host": socket.gethostname(), "backend": type(be).__name__,
            "bad": bad}


def partition(directory):
    r = dist.get_rank()
    x = np.ones(1 << 16, np.float32)
    calls, last = 0, time.monotonic()
    try:
        while True:
            dist.all_reduce(x)
            x[:] = 1
            calls += 1
            last = time.monotonic()
            if calls == 3:
                open(os.path.join(directory, f"ready.{r}"), "w").close()
    except dist.DistError as e:
        return {"rank": r, "calls": calls, "raised": type(e).__name__, "msg": str(e),
                "after": time.monotonic() - last}


def main():
    mode, directory = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT))
    result = check() if mode == "check" else partition(directory)
    print("RESULT " + json.dumps(result), flush=True)
    if mode == "check":
        dist.destroy_process_group()
    else:  # the group is broken: nothing to shut down cleanly; fail as an uncaught error
        time.sleep(1.5)  # would, once this node's other rank has raised too (the launcher
        os._exit(3)      # stops a node's ranks when one fails)


if __name__ == "__main__":
    main()
