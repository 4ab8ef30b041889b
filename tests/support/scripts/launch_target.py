"""A program for the launcher tests to start: ``launch_target.py MODE [ARGS]``."""
import json
import os
import signal
import subprocess
import sys
import time

VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def note_pid(directory, name, pid):
    with open(os.path.join(directory, f"{name}.pid.tmp"), "w") as f:
        f.write(str(pid))
    os.rename(os.path.join(directory, f"{name}.pid.tmp"), os.path.join(directory, f"{name}.pid"))


def wait_for_pids(directory, n):
    deadline = time.monotonic() + 30
    while sum(f.endswith(".pid") and f.startswith("rank") for f in os.listdir(directory)) < n:
        if time.monotonic() > deadline:
            sys.exit("the other ranks never started")
        time.sleep(0.01)


def main():
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if mode == "env":
        print(json.dumps({k: os.environ.get(k) for k in VARS}))
    elif mode == "lines":
        n = int(sys.argv[2])
        for i in range(n):  # each line in three writes, so a launcher that does not
            sys.stdout.write(f"line {i} ")  # buffer whole lines would interleave them
            sys.stdout.flush()
            sys.stdout.write(f"of rank {rank} ")
            sys.stdout.flush()
            sys.stdout.write("end\n")
            sys.stdout.flush()
            if i % 50 == 0:
                print(f"err {i} of rank {rank}", file=sys.stderr, flush=True)
        sys.stdout.write(f"no newline at the end from {rank}")
    elif mode in ("fail", "sleep", "stubborn"):
        directory = sys.argv[2]
        if mode == "stubborn" and rank != 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        note_pid(directory, f"child{rank}", child.pid)
        note_pid(directory, f"rank{rank}", os.getpid())
        wait_for_pids(directory, world)
        if (mode == "fail" and rank == 1) or (mode == "stubborn" and rank == 0):
            for i in range(30):
                print(f"stderr line {i} of the failing rank", file=sys.stderr)
            print(f"bye from rank {rank}", file=sys.stderr, flush=True)
            sys.exit(3)
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            print(f"rank {rank} got KeyboardInterrupt", flush=True)
            sys.exit(130)
    elif mode == "rdzv":
        from collectives.store.rendezvous import meet
        store, r, n = meet(timeout=30)
        store.set(f"k{r}", str(r * r))
        vals = [int(v) for v in store.multi_get([f"k{i}" for i in range(n)])]
        if r != 0:
            store.add("left", 1)
        else:
            while store.add("left", 0) < n - 1:
                time.sleep(0.002)
        print(f"rank {r} of {n} read {vals}")
    elif mode == "group":  # a group, destroyed and made again (torchrun's agent store)
        import numpy as np

        import collectives as dist
        for attempt in range(2):
            dist.init_process_group("gloo")
            a = np.full(3, dist.get_rank() + 1 + attempt, np.int64)
            dist.all_reduce(a)
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            os.write(1, f"restart {restart} rank {dist.get_rank()} of {dist.get_world_size()} "
                        f"attempt {attempt} sum {a.tolist()}\n".encode())  # one write each
            if sys.argv[2:] == ["fail-once"] and restart == "0" and rank == 1:
                sys.exit(3)  # torchrun --max-restarts starts every rank again
            dist.destroy_process_group()
    elif mode == "elastic":  # elastic [fail-node1-once | want-nodes N]: one all_reduce
        import numpy as np

        import collectives as dist
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if sys.argv[2:3] == ["fail-node1-once"] and os.environ["GROUP_RANK"] == "1" \
                and restart == 0:
            sys.exit(7)
        if sys.argv[2:3] == ["want-nodes"] and \
                int(os.environ["GROUP_WORLD_SIZE"]) < int(sys.argv[3]):
            time.sleep(120)  # the launcher restarts us once the other node has come
            sys.exit(3)
        dist.init_process_group("gloo")
        a = np.full(2, rank + 1, np.int64)
        dist.all_reduce(a)
        print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                          "node": int(os.environ["GROUP_RANK"]),
                          "nodes": int(os.environ["GROUP_WORLD_SIZE"]),
                          "local": int(os.environ["LOCAL_RANK"]), "restart": restart,
                          "sum": int(a[0])}), flush=True)
        dist.destroy_process_group()
    elif mode == "prompt":  # a prompt, an answer read from stdin, then the reply
        sys.stdout.write(f"rank {rank} asks> ")
        sys.stdout.flush()
        time.sleep(1.0)  # the prompt waits unfinished, as pdb's does for its input
        print(f"rank {rank} read {sys.stdin.readline().strip()!r}")
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
