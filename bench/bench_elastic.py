"""Recovery time after a rank is killed: elastic in place against restarting everyone.

One harness, one training program (a NumPy all_reduce step, a checkpoint or commit
each step), one rank killed with SIGKILL at step KILL; the time measured is from the
kill (the victim's clock, just before it sends itself SIGKILL) to the first step that
completes after it on the survivors (elastic) or on the restarted ranks (restart). The
failure-detection part is reported apart: from the kill to the first survivor's error
(elastic only; under a restart the launcher notices the exit).

Modes:
  elastic      collectives.elastic, ranks as plain processes, the store in this harness
  restart      collectives-run --max-restarts 1 (every rank stopped and started again;
               the program reloads its last checkpoint)
  torchrun     torchrun --max-restarts 1 running the same program (where torch is installed)

    python bench/bench_elastic.py --world 4 --repeat 5

Prints one line per run and the medians; absolute times on a shared 2-core machine are
noisy (say the load with any figure).
"""
import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30
KILL = 10
DIM = 1 << 12


def _log(event, **kw):
    kw.update(event=event, t=time.time(), pid=os.getpid())
    with open(os.path.join(os.environ["BENCH_OUT"], f"{os.getpid()}.log"), "a") as f:
        f.write(json.dumps(kw) + "\n")


def worker_elastic():
    import numpy as np

    import collectives as dist
    from collectives import elastic
    victim = int(os.environ["BENCH_VICTIM"])
    elastic.init(timeout=30)
    state = elastic.ObjectState(step=0, w=np.zeros(DIM))
    errors = []

    @elastic.run
    def train(state):
        if errors:
            _log("resumed", gen=elastic.generation())
        try:
            for step in range(state.step, STEPS):
                if step == KILL and elastic.generation() == 0 and dist.get_rank() == victim:
                    _log("kill")
                    os.kill(os.getpid(), signal.SIGKILL)
                g = np.full(DIM, 1.0)
                dist.all_reduce(g)
                state.w = state.w - g
                state.step = step + 1
                _log("step", step=step, gen=elastic.generation())
                state.commit()
        except Exception:
            if not errors:
                _log("error")
            errors.append(1)
            raise

    train(state)
    elastic.shutdown()


def worker_restart():
    """The same training under a restart-everyone launcher: rank 0 checkpoints each step,
    a restart reloads the checkpoint."""
    import numpy as np

    import collectives as dist
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = os.path.join(os.environ["BENCH_OUT"], "ckpt.npz")
    victim = int(os.environ["BENCH_VICTIM"])
    dist.init_process_group("gloo")
    step0, w = 0, np.zeros(DIM)
    if restart and os.path.exists(ckpt):
        z = np.load(ckpt)
        step0, w = int(z["step"]), z["w"]
    for step in range(step0, STEPS):
        if step == KILL and restart == 0 and dist.get_rank() == victim:
            _log("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        g = np.full(DIM, 1.0)
        dist.all_reduce(g)
        w = w - g
        _log("step", step=step, gen=restart)
        if dist.get_rank() == 0:
            np.savez(ckpt + ".tmp.npz", step=step + 1, w=w)
            os.replace(ckpt + ".tmp.npz", ckpt)
        dist.barrier()
    dist.destroy_process_group()


def _torchrun():
    """torchrun beside this interpreter (a virtual environment's), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return here if os.path.exists(here) else shutil.which("torchrun")


def _events(out):
    ev = []
    for f in glob.glob(os.path.join(out, "*.log")):
        with open(f) as fh:
            ev += [json.loads(line) for line in fh]
    return ev


def measure(ev):
    kill = next(e["t"] for e in ev if e["event"] == "kill")
    after = [e["t"] for e in ev if e["event"] == "step" and e["gen"] > 0]
    errs = [e["t"] for e in ev if e["event"] == "error"]
    steps_done = max(e["step"] for e in ev if e["event"] == "step") + 1
    return {"recovery_s": min(after) - kill if after else None,
            "detect_s": min(errs) - kill if errs else None, "steps": steps_done}


def run_once(mode, world, victim, timeout):
    out = tempfile.mkdtemp(prefix="bench-elastic-")
    env = dict(os.environ, BENCH_OUT=out, BENCH_VICTIM=str(victim), PYTHONPATH=ROOT,
               OMP_NUM_THREADS="1")
    me = [os.path.abspath(__file__)]
    try:
        if mode == "elastic":
            from collectives.store import TCPStore
            store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            env.update(COLLECTIVES_ELASTIC_STORE=f"127.0.0.1:{store.port}",
                       COLLECTIVES_ELASTIC_NP=str(world))
            env.pop("COLLECTIVES_AUTH_KEY", None)
            procs = [subprocess.Popen([sys.executable, *me, "--worker", "elastic"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for _ in range(world)]
            for p in procs:
                p.wait(timeout)
            store.close()
        else:
            if mode == "restart":
                cmd = [sys.executable, "-m", "collectives.run"]
            else:
                cmd = [_torchrun(), "--standalone"]
            cmd += ["--nproc-per-node", str(world), "--max-restarts", "1", *me, "--worker",
                    "restart"]
            subprocess.run(cmd, env=env, timeout=timeout, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        return measure(_events(out))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--modes", default="elastic,restart,torchrun")
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "elastic":
        return worker_elastic()
    if args.worker == "restart":
        return worker_restart()
    modes = [m for m in args.modes.split(",") if m]
    if "torchrun" in modes and _torchrun() is None:
        print("torchrun: not installed, skipped")
        modes.remove("torchrun")
    got = {m: [] for m in modes}
    print(f"world {args.world}, kill at step {KILL} of {STEPS}, load {os.getloadavg()[0]:.2f}")
    for i in range(args.repeat):
        for m in modes:  # interleaved, so that the load falls on every mode alike
            victim = i % args.world
            r = run_once(m, args.world, victim, args.timeout)
            got[m].append(r)
            print(f"{m:9s} run {i} victim {victim}: recovery {r['recovery_s']:.3f} s"
                  + (f" (detection {r['detect_s']:.3f} s)" if r["detect_s"] is not None else "")
                  + f", steps {r['steps']}", flush=True)
    print(f"medians (load {os.getloadavg()[0]:.2f}):")
    for m in modes:
        rec = [r["recovery_s"] for r in got[m] if r["recovery_s"] is not None]
        det = [r["detect_s"] for r in got[m] if r["detect_s"] is not None]
        print(f"  {m:9s} recovery {statistics.median(rec):.3f} s (min {min(rec):.3f}, max "
              f"{max(rec):.3f}, n={len(rec)})"
              + (f", detection {statistics.median(det):.3f} s" if det else ""))


if __name__ == "__main__":
    main()
