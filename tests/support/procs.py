"""Programs that tests start as subprocesses (one per rank): read what they print, and leave
none behind."""
import contextlib
import json


@contextlib.contextmanager
def reaped(procs):
    """On leaving (done, a timeout, a failed check), kill each of ``procs`` still running,
    and reap them all."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def json_results(procs, timeout, skip=()):
    """``{rank: the last JSON line it printed}`` of each rank's process in ``procs`` but
    those in ``skip``, each awaited up to ``timeout`` s; a rank that printed none fails the
    test with its output."""
    results = {}
    with reaped(procs):
        for r, p in enumerate(procs):
            if r in skip:
                continue
            out, err = p.communicate(timeout=timeout)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            assert lines, f"rank {r} printed no result (exit {p.returncode}):\n{out}\n{err}"
            results[r] = json.loads(lines[-1])
    return results
