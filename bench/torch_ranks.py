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
    outs, failed = [], []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{label}: timed out after {timeout} s") from None
            if p.returncode:
                failed.append(err)
            outs.append(out)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    result = None
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
    if failed and not (result is not None and all(_TEARDOWN in err for err in failed)):
        raise SystemExit(f"{label} failed:\n{failed[0][-3000:]}")
    if result is None:
        raise SystemExit(f"{label}: rank 0 printed no result")
    if failed:  # every step was measured and reported; a rank died in torch's own teardown
        print(f"# {label}: {len(failed)} rank(s) aborted at exit after the result "
              f"({_TEARDOWN!r}); the result stands", file=sys.stderr, flush=True)
    return result


#: what torch's C++ teardown prints when it aborts a rank at exit (now and then, torch gloo's
#: own runs included), after the measured part has ended and rank 0 has printed its result
_TEARDOWN = "terminate called without an active exception"
