"""Start a torch-style job's ranks for the training benchmarks (bench_ddp.py,
bench_train.py): ``script --worker`` once per rank with torchrun's environment, and rank 0's
``RESULT <json>`` line read back."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(script, world, env, timeout, label, root=ROOT, threads=1):
    """Run ``world`` ranks of ``script --worker`` (``env`` added to each one's environment,
    ``root`` first on PYTHONPATH); returns rank 0's RESULT, SystemExit naming ``label``
    when a rank fails, times out, or rank 0 prints none."""
    from collectives.run import free_port
    port = free_port()
    procs = []
    for r in range(world):
        renv = dict(os.environ, **env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                    LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads),
                    PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, script, "--worker"], env=renv,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{label}: timed out after {timeout} s") from None
            if p.returncode:
                raise SystemExit(f"{label} failed:\n{err[-3000:]}")
            outs.append(out)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{label}: rank 0 printed no result")
