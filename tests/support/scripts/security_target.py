"""A job for tests/store_launch/test_security.py, run under collectives-run with the TCP transport.

    security_target.py MODE INIT DIR

MODE "attack": every rank that accepts connections while the mesh forms writes its
listener's port to DIR/listen.<rank> and waits (at most 60 s) for DIR/go.<rank>, so that the
test can attack those ports (and the store's) first; then the ranks run all_reduce
rounds until DIR/done appears, checking each result, and print a RESULT line.
MODE "keys": the ranks count the authentication handshakes their connections made and
print them in a RESULT line (with a digest of the key, never the key).
INIT: env, tcp or file (tcp:// and file:// are built from MASTER_ADDR/PORT and DIR).
"""
import hashlib
import json
import os
import sys
import time

import numpy as np

import collectives as dist
from collectives.security import auth
from collectives.backends.tcp import mesh

mode, init, directory = sys.argv[1], sys.argv[2], sys.argv[3]
rank = int(os.environ["RANK"])
handshakes = {"store": 0, "mesh": 0}
real_finish = auth.client_finish


def counting_finish(sock, key, nc, deadline, where, *args, **kwargs):
    handshakes["mesh" if where.startswith("tcp backend") else "store"] += 1
    return real_finish(sock, key, nc, deadline, where, *args, **kwargs)


auth.client_finish = counting_finish  # every client handshake ends here

if mode == "attack":
    real_accept = mesh.accept_peers

    def accept_after_attack(listener, *args, **kwargs):
        path = os.path.join(directory, f"listen.{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps({"port": listener.getsockname()[1],
                                "store": int(os.environ["MASTER_PORT"])}))
        os.rename(path + ".tmp", path)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(directory, f"go.{rank}")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return real_accept(listener, *args, **kwargs)

    mesh.accept_peers = accept_after_attack

url = {"env": "env://",
       "tcp": f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
       "file": "file://" + os.path.join(directory, "rendezvous")}[init]
dist.init_process_group("gloo", init_method=url, timeout=60)
world = dist.get_world_size()
result = {"rank": rank}

if mode == "attack":
    bad = []
    rounds = 0
    deadline = time.monotonic() + 90
    while True:
        x = np.arange(1000, dtype=np.float64) * (rank + 1)
        dist.all_reduce(x)
        if not np.array_equal(x, np.arange(1000, dtype=np.float64) * (world * (world + 1) // 2)):
            bad.append(rounds)
        rounds += 1
        flag = np.array([os.path.exists(os.path.join(directory, "done"))], np.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank stops after the same round
        if flag[0] or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    result.update(handshakes, rounds=rounds, bad=bad, timed_out=not bool(flag[0]))
    got = [None] * world
    dist.all_gather_object(got, rank, safe=True)
    result["objects"] = got
else:
    key = os.environ.get(auth.ENV_KEY, "")
    result.update(handshakes, key_digest=hashlib.sha256(key.encode()).hexdigest()[:16],
                  key_len=len(key))
    x = np.ones(8) * rank
    dist.all_reduce(x)
    result["sum_ok"] = bool((x == world * (world - 1) / 2).all())
dist.destroy_process_group()
print("RESULT " + json.dumps(result), flush=True)
