"""The flight recorder, its dumps, ``collectives-trace``, and timeout errors that name the
ranks that never joined.

Property: when one rank of a job skips a collective, calls a different one, or dies, every
rank that could dumps its recent calls, ``collectives-trace`` over the dumps alone names
the rank and what it did instead, and a rank whose call timed out says in its error which
ranks did not join and where they are. Ranks are plain processes (one may die), as in
tests/backends/test_faults.py; the group timeout is short.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.procs import json_results, reaped
from tests.support.profiles import examples
from tests.support.ranks import CONFIGS, ROOT, available_configs, free_port
from tests.support.requires import needs_gloo
from tests.support.marks import quick_only

GROUP_TIMEOUT = 2.0
WORLD = 3
COUNT = 100

# mpiexec ends the whole job when a rank dies, and MPI cannot interrupt a blocked
# collective: a skipped one hangs there. The fault scenarios need spawned ranks.
FAULT_CONFIGS = [c for c in available_configs() if CONFIGS[c][1] == "spawn" and c != "store"]
if "mpi" in available_configs():
    FAULT_CONFIGS.append(pytest.param("mpi", marks=pytest.mark.skip(
        reason="MPI cannot interrupt a blocked collective (the others would hang in the skipped "
               "one) and mpiexec ends the job when a rank dies; test_mpi_dumps_on_demand and "
               "test_mpi_watchdog_dumps_before_it_ends_the_job cover mpi")))


# ---- the ranks' side ------------------------------------------------------------------

def worker():
    """One rank: two collectives that work, then rank FR_VICTIM misbehaves (FR_MODE: skip,
    mismatch, die) in the third; every rank prints what its third call did."""
    from datetime import timedelta

    import collectives as dist
    mode, victim = os.environ["FR_MODE"], int(os.environ["FR_VICTIM"])
    dist.init_process_group(os.environ["FR_BACKEND"], timeout=timedelta(seconds=GROUP_TIMEOUT))
    rank = dist.get_rank()
    t = np.ones(COUNT, np.float32)
    dist.all_reduce(t)  # #1
    dist.broadcast(t, 0)  # #2
    if rank == victim and mode == "skip":
        # skips #3 and computes on; its flight recorder dumps when the others ask
        mine = f"{os.environ['FR_PREFIX']}{rank}"
        deadline = time.monotonic() + GROUP_TIMEOUT + 20
        while not os.path.exists(mine) and time.monotonic() < deadline:
            time.sleep(0.1)
        print(json.dumps({"skipped": True, "dumped": os.path.exists(mine)}), flush=True)
        os._exit(0)
    if rank == victim and mode == "die":
        time.sleep(1.0)  # its last progress is posted meanwhile
        os._exit(17)
    result = {}
    t0 = time.monotonic()
    try:
        if rank == victim and mode == "mismatch":
            dist.broadcast(t, 1)  # the others call all_reduce as #3
        else:
            dist.all_reduce(t)
        result["raised"] = None
    except dist.DistError as e:
        result.update(raised=type(e).__name__, msg=str(e))
    result["elapsed"] = time.monotonic() - t0
    if mode == "mismatch":
        result["dump"] = dist.dump_flight_recorder()
    print(json.dumps(result), flush=True)
    os._exit(0)


SIGNAL_TIMEOUT = 6.0


def sigusr1_worker():
    """Rank 0 waits in a barrier rank 1 never joins; the test sends it SIGUSR1 meanwhile.
    FR_OWN_HANDLER: the program has a SIGUSR1 handler of its own."""
    from datetime import timedelta

    import collectives as dist
    if os.environ.get("FR_OWN_HANDLER"):
        signal.signal(signal.SIGUSR1, lambda *_: print(json.dumps({"own_handler": True}), flush=True))
    dist.init_process_group("gloo", timeout=timedelta(seconds=SIGNAL_TIMEOUT))
    t = np.ones(4, np.float32)
    dist.all_reduce(t)
    print(json.dumps({"ready": True}), flush=True)
    if dist.get_rank() == 0:
        try:
            dist.barrier()
        except dist.DistError:
            pass
    else:
        time.sleep(SIGNAL_TIMEOUT + 10)
    os._exit(0)


# ---- the test's side ------------------------------------------------------------------

def spawn(config, module_fn, world, **env_extra):
    backend, _, extra_env = CONFIGS[config]
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   FR_BACKEND=backend, FR_MAIN=module_fn, OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **extra_env, **env_extra)
        for k in ("TORCH_FR_DUMP_TEMP_FILE", "COLLECTIVES_FR_DUMP", "TORCH_FR_BUFFER_SIZE"):
            if k not in env_extra:
                env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.diagnostics.test_flight_recorder"],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def run_scenario(config, mode, tmp_path, victim=1):
    prefix = str(tmp_path / "fr-rank")
    # one setting each way: torch's name and ours
    var = "TORCH_FR_DUMP_TEMP_FILE" if mode != "mismatch" else "COLLECTIVES_FR_DUMP"
    procs = spawn(config, "worker", WORLD, FR_MODE=mode, FR_VICTIM=str(victim), FR_PREFIX=prefix,
                  **{var: prefix})
    return prefix, json_results(procs, 90, skip=(victim,) if mode == "die" else ())


def trace(where, *args):
    p = subprocess.run([sys.executable, "-m", "collectives.diagnostics.trace", where, *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.faults
@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", FAULT_CONFIGS)
def test_a_skipped_collective_is_named_by_the_timeout_error_and_by_the_trace(config, tmp_path):
    prefix, res = run_scenario(config, "skip", tmp_path)
    assert res[1] == {"skipped": True, "dumped": True}, res[1]  # dumped at the others' request
    for r in (0, 2):
        assert res[r]["raised"] == "DistBackendError", res[r]
        msg = res[r]["msg"]
        assert msg.startswith(f"all_reduce(float32, {COUNT}, op=SUM) #3 in group default_pg timed "
                              f"out after 2 s: ranks {{1}} did not join it"), msg
        assert f"rank 1 last completed #2 broadcast(src=0, float32, {COUNT})" in msg, msg
        assert f"rank {2 - r} is in #3" in msg, msg
        assert "Timed out waiting 2000ms" in msg, msg  # the backend's words stay
        assert f"[flight recorder: {prefix}{r};" in msg, msg
    for r in range(WORLD):
        assert os.path.exists(f"{prefix}{r}")
    out = trace(prefix)
    verdict = out.split("recent history")[0]
    assert "group default_pg (ranks [0, 1, 2]): the ranks part at collective #3" in verdict, out
    assert "missing ranks: {1} (never joined #3)" in verdict, out
    assert f"rank 1 last completed #2 broadcast(src=0, float32, {COUNT})" in verdict, out
    assert f"ranks {{0, 2}} called all_reduce(float32, {COUNT}, op=SUM)" in verdict, out
    for r in (0, 2):  # with their errors
        assert f"rank {r} failed: all_reduce(float32, {COUNT}, op=SUM) #3 in group default_pg timed out" \
            in verdict, out
    assert "no dump from" not in out, out
    data = json.loads(trace(prefix, "--json"))
    g = data["groups"][0]
    assert (g["group"], g["seq"], g["missing"], sorted(g["failed"])) == ("default_pg", 3, [1], ["0", "2"])
    assert data["no_dump"] == [] and data["dumps"] == [0, 1, 2], data
    # one rank's file is enough to find its job's others
    assert "missing ranks: {1}" in trace(f"{prefix}2")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", FAULT_CONFIGS)
def test_a_different_collective_is_named_by_the_trace(config, tmp_path):
    prefix, res = run_scenario(config, "mismatch", tmp_path)
    for r in range(WORLD):
        assert res[r]["dump"] == f"{prefix}{r}", res[r]
    out = trace(prefix)
    verdict = out.split("recent history")[0]
    assert "the ranks part at collective #3" in verdict, out
    assert "different calls at #3:" in verdict, out
    assert f"ranks {{1}} called broadcast(src=1, float32, {COUNT})" in verdict, out
    assert f"ranks {{0, 2}} called all_reduce(float32, {COUNT}, op=SUM)" in verdict, out


@pytest.mark.faults
@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", FAULT_CONFIGS)
def test_a_rank_that_died_is_reported_without_its_dump(config, tmp_path):
    prefix, res = run_scenario(config, "die", tmp_path, victim=2)
    for r in (0, 1):
        assert res[r]["raised"] in ("DistBackendError", "DistNetworkError"), res[r]
        assert f"[flight recorder: {prefix}{r};" in res[r]["msg"], res[r]
        assert os.path.exists(f"{prefix}{r}")
        msg = res[r]["msg"]
        if "timed out" in msg:  # noticed by the timeout, not a closed connection: named anyway
            assert "rank 2 last completed #2" in msg, msg
    assert not os.path.exists(f"{prefix}2")
    out = trace(prefix)
    verdict = out.split("recent history")[0]
    assert "no dump from rank 2 (died or never dumped)" in verdict, out
    assert "the ranks part at collective #3" in verdict, out
    assert "rank 0 failed:" in verdict and "rank 1 failed:" in verdict, out


@pytest.mark.timeout(120)
# quick: a program without a SIGUSR1 handler of its own (the recorder's wakeup fd)
@pytest.mark.parametrize("own_handler", quick_only([False, True], False))
def test_sigusr1_dumps_a_rank_blocked_in_a_collective(tmp_path, own_handler):
    """The dump comes while rank 0 still waits in the barrier (the GIL released in C), and a
    program's own handler still runs."""
    if "gloo" not in available_configs():
        pytest.skip("the gloo configuration is not available")
    prefix = str(tmp_path / "sig-rank")
    extra = {"FR_OWN_HANDLER": "1"} if own_handler else {}
    procs = spawn("gloo", "sigusr1_worker", 2, TORCH_FR_DUMP_TEMP_FILE=prefix, **extra)
    with reaped(procs):
        p0 = procs[0]
        assert json.loads(p0.stdout.readline()) == {"ready": True}
        time.sleep(0.5)  # in the barrier by now
        p0.send_signal(signal.SIGUSR1)
        path = f"{prefix}0"
        deadline = time.monotonic() + SIGNAL_TIMEOUT - 1.5
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(path), "no dump while the rank waited in the barrier"
        with open(path) as f:
            d = json.load(f)
        assert d["reason"] == "SIGUSR1" and d["rank"] == 0, d
        g = d["groups"]["default_pg"]
        assert (g["issued"], g["completed"]) == (2, 1), g
        assert g["entries"][-1]["call"] == "barrier()" and g["entries"][-1]["state"] == "started", g
        assert p0.poll() is None  # still waiting: the signal did not end it
        if own_handler:  # it runs once the main thread is back in Python (the barrier's timeout)
            out, _ = p0.communicate(timeout=60)
            assert '{"own_handler": true}' in out, out


MPI_PROGRAM = """
import os, sys
import numpy as np
import collectives as dist
dist.init_process_group("mpi")
t = np.ones(8, np.float32)
dist.all_reduce(t)
dist.broadcast(t, 1)
dist.barrier()
w = dist.all_reduce(t, async_op=True)  # posted natively (Iallreduce), not queued
assert type(w._req._req).__name__ == "MpiRequest", type(w._req._req)
w.wait()
if dist.get_rank() == 0:
    dist.send(t, 1)
elif dist.get_rank() == 1:
    dist.recv(t, 0)
print(dist.dump_flight_recorder(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_mpi_dumps_on_demand(tmp_path):
    """mpi under mpiexec (no store): the recorder records and dumps, and the trace reads it."""
    if "mpi" not in available_configs():
        pytest.skip("the mpi configuration is not available (mpi4py and mpiexec)")
    from tests.support.ranks import mpiexec_path
    prefix = str(tmp_path / "mpi-rank")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", COLLECTIVES_FR_DUMP=prefix)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCH_FR_DUMP_TEMP_FILE"):
        env.pop(k, None)
    p = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, "-c", MPI_PROGRAM], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    # (the ranks' lines may interleave)
    assert sorted(re.findall(re.escape(prefix) + r"\d", p.stdout)) == [f"{prefix}{r}" for r in range(3)], \
        p.stdout
    out = trace(prefix)
    assert "group default_pg (ranks [0, 1, 2]): every rank that dumped completed #4; the ranks did " \
           "not part" in out, out
    assert "#2 broadcast(src=1, float32, 8)  completed" in out, out
    assert "send(peer=1, tag=0, float32, 8)  completed" in out, out
    assert "recv(peer=0, tag=0, float32, 8)  completed" in out, out


MPI_HANG = """
import time
from datetime import timedelta
import numpy as np
import collectives as dist
dist.init_process_group("mpi", timeout=timedelta(seconds=2))
t = np.ones(8, np.float32)
dist.all_reduce(t)
if dist.get_rank() == 0:
    dist.barrier()  # rank 1 never joins: the watchdog ends the job past the timeout
else:
    time.sleep(60)
"""


@pytest.mark.timeout(180)
def test_mpi_watchdog_dumps_before_it_ends_the_job(tmp_path):
    """MPI cannot time a blocked collective out: the watchdog ends the job, and the rank
    whose call hung leaves its dump first."""
    if "mpi" not in available_configs():
        pytest.skip("the mpi configuration is not available (mpi4py and mpiexec)")
    from tests.support.ranks import mpiexec_path
    prefix = str(tmp_path / "hang-rank")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", COLLECTIVES_FR_DUMP=prefix)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCH_FR_DUMP_TEMP_FILE",
              "COLLECTIVES_MPI_WATCHDOG"):
        env.pop(k, None)
    p = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, "-c", MPI_HANG], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode != 0
    assert f"flight recorder dump: {prefix}0" in err, err
    with open(f"{prefix}0") as f:
        d = json.load(f)
    assert d["reason"].startswith("mpi watchdog: barrier ran"), d["reason"]
    out = trace(prefix)
    assert "no dump from rank 1 (died or never dumped)" in out, out
    assert "the ranks part at collective #2" in out and "ranks {0} called barrier()" in out, out
    assert "in #2 when they dumped: ranks {0}" in out, out


# ---- one process: the recorder itself --------------------------------------------------

@pytest.fixture
def world1(monkeypatch):
    import collectives as dist
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


@needs_gloo
def test_every_front_end_call_is_recorded_with_what_was_called(world1, tmp_path):
    dist = world1
    t = np.ones(6, np.float32)
    out = np.zeros(6, np.float32)
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.broadcast(t, 0)
    dist.barrier()
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(out[:6], t)
    dist.all_reduce(t, async_op=True).wait()
    dist.reduce(t, 0, op=dist.ReduceOp.MIN)
    dist.all_gather_object([None], {"x": 1})
    path = dist.dump_flight_recorder(str(tmp_path / "d"))
    with open(path) as f:
        d = json.load(f)
    g = d["groups"]["default_pg"]
    calls = [e["call"] for e in g["entries"]]
    assert calls == ["all_reduce(float32, 6, op=SUM)", "all_reduce(float32, 6, op=MAX)",
                     "broadcast(src=0, float32, 6)", "barrier()", "all_gather(float32, 6)",
                     "reduce_scatter(float32, 6, op=SUM)", "all_reduce(float32, 6, op=SUM)",
                     "reduce(dst=0, float32, 6, op=MIN)", "all_gather(int64, 1)",
                     calls[9]], calls
    assert calls[9].startswith("all_gather(uint8, ")  # the pickle, padded
    assert [e["seq"] for e in g["entries"]] == list(range(1, 11))
    assert {e["state"] for e in g["entries"]} == {"completed"}
    assert (g["issued"], g["completed"], d["format"], d["version"]) == (10, 10,
                                                                       "collectives-flight-recorder", 1)


def test_the_ring_keeps_the_last_entries_and_the_counters_say_their_state():
    from collectives.diagnostics import flight_recorder as fr
    rec = fr.Recorder("g", [0, 1], 0, "gloo")
    n = rec.size + 5
    for _ in range(n):
        s = rec.issue("all_reduce", 3, 2, -1, 0)
        rec.started = rec.done = s
    s = rec.issue("broadcast", 3, 2, 1)
    rec.started = s
    snap = rec.snapshot(0)
    seqs = [e["seq"] for e in snap["entries"]]
    assert seqs == list(range(n + 2 - rec.size, n + 2))  # the oldest left the ring
    assert snap["entries"][-1]["state"] == "started"
    assert snap["entries"][-1]["call"] == "broadcast(src=1, float32, 3)"
    assert snap["entries"][-2]["state"] == "completed"
    assert rec.entry(1) is None and rec.entry(n + 1)[1] == "broadcast"
    assert rec.progress() == [n + 1, n, "broadcast(src=1, float32, 3)", "all_reduce(float32, 3, op=SUM)", 0]


@needs_gloo
def test_a_dump_that_cannot_be_written_warns_and_returns_none(world1, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="could not write a dump"):
        assert world1.dump_flight_recorder(str(blocker / "sub" / "d")) is None


@needs_gloo
def test_a_backend_reaches_the_recorders_dump_through_the_hook_it_registers(world1, tmp_path,
                                                                            monkeypatch):
    """The mpi watchdog dumps before MPI_Abort through backends.base.dump_recorder: the
    flight recorder (a layer above the backends) registers its dump there at import."""
    from collectives.backends import base
    from collectives.diagnostics import progress
    monkeypatch.setattr(progress, "DUMP_PREFIX", str(tmp_path / "hang-rank"))
    world1.all_reduce(np.ones(3, np.float32))
    path = base.dump_recorder("mpi watchdog: all_reduce ran 9.0 s, past the group timeout")
    assert path == str(tmp_path / "hang-rank0")
    with open(path) as f:
        d = json.load(f)
    assert d["reason"] == "mpi watchdog: all_reduce ran 9.0 s, past the group timeout"
    assert [e["call"] for e in d["groups"]["default_pg"]["entries"]] == ["all_reduce(float32, 3, op=SUM)"]


def test_trace_says_so_when_there_are_no_dumps(tmp_path):
    p = subprocess.run([sys.executable, "-m", "collectives.diagnostics.trace",
                        str(tmp_path / "none-")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 2 and "no flight-recorder dumps found" in p.stderr


if __name__ == "__main__":
    globals()[os.environ.get("FR_MAIN", "worker")]()


# ---- collectives-trace's verdict, as a property over drawn histories ---------------------

def _dumps_of(histories, world):
    """Dumps (as collectives-trace reads them) of ranks whose recorders saw ``histories``:
    rank -> (calls issued [(kind, count, dtype, root, op)], number completed, failed seq)."""
    from collectives.diagnostics import flight_recorder as fr, progress
    dumps = {}
    for r, (calls, done, failed) in histories.items():
        rec = fr.Recorder("default_pg", list(range(world)), r, "gloo")
        for call in calls:
            s = rec.issue(*call)
            rec.started = s
            if s <= done:
                rec.done = s
        if failed:
            rec.failures[failed] = (f"rank {r} failed", 0.0)
        dumps[r] = {"format": progress.FORMAT, "version": progress.VERSION, "rank": r, "world_size": world,
                    "job": "j", "time": 0.0, "groups": {"default_pg": rec.snapshot(0)}}
    return dumps


def test_the_verdict_names_the_first_collective_not_every_rank_completed():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from collectives.diagnostics import trace

    @settings(max_examples=examples(60), deadline=None)
    @given(st.data())
    def check(data):
        world = data.draw(st.integers(2, 5), label="world")
        n = data.draw(st.integers(1, 6), label="collectives everyone issues")
        common = [("all_reduce", 4, 2, -1, 0)] * n
        histories, part = {}, None
        for r in range(world):
            issued = data.draw(st.integers(max(0, n - 2), n), label=f"rank {r} issued")
            done = data.draw(st.integers(max(0, issued - 1), issued), label=f"rank {r} completed")
            calls = list(common[:issued])
            odd = data.draw(st.booleans(), label=f"rank {r} calls another collective last") and issued
            if odd:
                calls[-1] = ("broadcast", 4, 2, r, -1)
            histories[r] = (calls, done, 0)
        dumps = _dumps_of(histories, world)
        v = trace.analyse(dumps)["groups"][0]
        # the reference: the first number some rank issued and another did not complete, or
        # whose calls differ
        for s in range(1, max(len(h[0]) for h in histories.values()) + 1):
            states = [(h[1] >= s, h[0][s - 1] if s <= len(h[0]) else None) for h in histories.values()]
            calls = {c for _, c in states if c is not None}
            if not all(done for done, _ in states) or len(calls) > 1:
                part = s
                break
        if part is None:
            assert v["seq"] is None, v
            return
        assert v["seq"] == part, (v, histories)
        assert v["missing"] == [r for r, h in histories.items() if len(h[0]) < part], v
        called = {}
        for r, h in histories.items():
            if len(h[0]) >= part:
                called.setdefault(trace_call(h[0][part - 1]), []).append(r)
        assert v["calls"] == called, (v, histories)

    def trace_call(call):
        from collectives.diagnostics.fr_registry import describe
        return describe((0,) + call)

    check()


def test_a_peer_process_that_is_gone_is_told_from_one_that_lives():
    from collectives.diagnostics import progress
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert progress._gone(progress._HOST, p.pid) == p.pid
    assert progress._gone(progress._HOST, os.getpid()) is None
    assert progress._gone("another host|pid:[1]", p.pid) is None  # not ours to look up
