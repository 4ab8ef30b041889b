"""Elastic training in place: survivors keep training, newcomers join, nobody restarts.

Ranks are plain processes (tests/elastic/programs.py) meeting through a store this test
process serves, outside every rank, so that any rank may die, rank 0 included. The
training sums small-integer gradients, so every split of a step's batch over any world
gives the same float64 bits: the survivors' final parameters must equal the fault-free
reference exactly.
"""
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from collectives.store import TCPStore
from tests.elastic.programs import members_log, reference, wait_until
from tests.support.ranks import ROOT
from tests.support.requires import needs_gloo

pytestmark = [pytest.mark.faults, needs_gloo]  # the elastic groups run on gloo

STEPS = 20
KILL_STEP = 5


def store_server():
    return TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                    wait_for_workers=False)


def job_env(store, out, **extra):
    env = dict(os.environ, ELASTIC_OUT=str(out), ELASTIC_STEPS=str(STEPS), PYTHONPATH=ROOT)
    if store is not None:
        env["COLLECTIVES_ELASTIC_STORE"] = f"127.0.0.1:{store.port}"
    env.pop("COLLECTIVES_AUTH_KEY", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(env, n=1):
    return [subprocess.Popen([sys.executable, "-m", "tests.elastic.programs"], env=env,
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for _ in range(n)]


def finish(procs, timeout):
    """{pid: (returncode, output)}; every process is killed by ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    got = {}
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        got[p.pid] = (p.returncode, out.decode(errors="replace"))
    return got


def results(out):
    return {r["pid"]: r for r in (json.load(open(f)) for f in glob.glob(f"{out}/*.json"))}


def check_survivors(got, res, n_alive, expect_world, ref_steps=STEPS):
    """Every survivor exited 0 and wrote the reference's bits; none was restarted (the
    pids that finished are the ones started)."""
    dead = [pid for pid, (rc, _) in got.items() if rc == -signal.SIGKILL]
    bad = {pid: out[-3000:] for pid, (rc, out) in got.items() if rc not in (0, -signal.SIGKILL)}
    assert not bad, f"processes failed: {bad}"
    assert set(res) == set(got) - set(dead), (sorted(res), sorted(got), dead)
    assert len(res) == n_alive
    ref = reference(ref_steps).tobytes().hex()
    for r in res.values():
        assert r["step"] == ref_steps
        assert r["w"] == ref, f"rank {r['rank']}: parameters differ from the reference"
        assert r["world"] == expect_world
    assert sorted(r["rank"] for r in res.values()) == list(range(expect_world))
    return dead


# every rank's death, one at a time, rank 0 included, at worlds 2-4 (world 4: slow but one)
CASES = [(n, v) for n in (2, 3, 4) for v in range(n)]


def _mark(n, v):
    return [pytest.mark.slow] if n == 4 and v != 0 else []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("n,victim", [pytest.param(n, v, marks=_mark(n, v), id=f"w{n}-kill{v}")
                                      for n, v in CASES])
def test_survivors_finish_with_the_reference_state(tmp_path, n, victim, transport):
    store = store_server()
    env = job_env(store, tmp_path, COLLECTIVES_ELASTIC_NP=n, ELASTIC_VICTIM=victim,
                  ELASTIC_KILL_STEP=KILL_STEP, COLLECTIVES_TRANSPORT=transport)
    got = finish(start(env, n), 90)
    res = results(tmp_path)
    dead = check_survivors(got, res, n - 1, n - 1)
    assert len(dead) == 1
    for r in res.values():
        assert r["gen"] == 1 and r["resets"] == 1
        assert r["worlds"] == [[0, n], [1, n - 1]]
    store.close()


@pytest.mark.timeout(120)
def test_a_newcomer_is_admitted_at_a_commit_and_gets_the_state(tmp_path):
    """Two members train slowly; a third process started later against the same store is
    admitted at their next commit, receives the state, and all three finish together,
    numbered 0..2 with the newcomer last."""
    store = store_server()
    env = job_env(store, tmp_path, COLLECTIVES_ELASTIC_NP=2, ELASTIC_STEP_SLEEP=0.15)
    first = start(env, 2)
    late = start(dict(env, ELASTIC_JOIN_AFTER="0"), 1)
    got = finish(first + late, 90)
    res = results(tmp_path)
    check_survivors(got, res, 3, 3)
    new = res[late[0].pid]
    assert new["newcomer"] and new["rank"] == 2 and new["gen"] == 1
    assert all(r["gen"] == 1 for r in res.values())
    store.close()


@pytest.mark.timeout(120)
def test_a_death_and_a_newcomer(tmp_path):
    """Rank 0 of three dies; a newcomer arrives: the job ends with three members again."""
    store = store_server()
    env = job_env(store, tmp_path, COLLECTIVES_ELASTIC_NP=3, ELASTIC_VICTIM=0,
                  ELASTIC_KILL_STEP=KILL_STEP, ELASTIC_STEP_SLEEP=0.1)
    first = start(env, 3)
    late = start(dict(env, ELASTIC_JOIN_AFTER="1"), 1)
    got = finish(first + late, 90)
    res = results(tmp_path)
    check_survivors(got, res, 3, 3)
    assert res[late[0].pid]["rank"] == 2
    store.close()


@pytest.mark.timeout(60)
def test_below_min_np_the_survivors_wait_then_fail_clearly(tmp_path):
    store = store_server()
    env = job_env(store, tmp_path, COLLECTIVES_ELASTIC_NP=2, COLLECTIVES_ELASTIC_MIN_NP=2,
                  COLLECTIVES_ELASTIC_TIMEOUT=3, ELASTIC_VICTIM=1, ELASTIC_KILL_STEP=KILL_STEP)
    t0 = time.monotonic()
    got = finish(start(env, 2), 45)
    assert time.monotonic() - t0 >= 3
    rcs = sorted(rc for rc, _ in got.values())
    assert rcs == [-signal.SIGKILL, 1]
    out = next(o for rc, o in got.values() if rc == 1)
    assert "ElasticError" in out and "below min_np=2" in out
    store.close()


@pytest.mark.timeout(60)
def test_max_np_keeps_newcomers_out(tmp_path):
    store = store_server()
    env = job_env(store, tmp_path, COLLECTIVES_ELASTIC_NP=2, COLLECTIVES_ELASTIC_MAX_NP=2,
                  COLLECTIVES_ELASTIC_TIMEOUT=4, ELASTIC_STEP_SLEEP=0.05)
    first = start(env, 2)
    late = start(dict(env, ELASTIC_JOIN_AFTER="0"), 1)
    got = finish(first, 60)
    res = results(tmp_path)
    assert all(rc == 0 for rc, _ in got.values())
    assert len(res) == 2 and all(r["gen"] == 0 and r["world"] == 2 for r in res.values())
    rc, out = finish(late, 30)[late[0].pid]
    assert rc == 1 and "ElasticError" in out and "has finished" in out, out[-2000:]
    store.close()


def test_lease_goes_with_its_connection():
    """The store server deletes a leased key, and sets its close key, when the holder's
    connection closes (what tells the members that a process died)."""
    server = store_server()
    holder = TCPStore("127.0.0.1", server.port, None, False, wait_for_workers=False)
    holder.lease("alive/a", b"1", "broken", b"a")
    assert server.check(["alive/a"]) and not server.check(["broken"])
    holder.lease("alive/a", b"1", "broken2", b"a")  # a new close action replaces the old
    holder.close()
    server.wait(["broken2"], datetime.timedelta(seconds=5))
    assert server.get("broken2") == b"a"
    assert not server.check(["alive/a"]) and not server.check(["broken"])
    server.close()


def test_misuse_raises_before_anything_is_sent():
    from collectives import elastic
    with pytest.raises(ValueError, match="elastic.init"):
        elastic.current()
    with pytest.raises(ValueError, match="max_np"):
        elastic.init("127.0.0.1:1", min_np=3, max_np=2)
    with pytest.raises(ValueError, match="min_np"):
        elastic.init("127.0.0.1:1", min_np=0)
    with pytest.raises(ValueError, match="host:port"):
        elastic.init("nowhere")
    state = elastic.ObjectState(x=1)
    with pytest.raises(TypeError, match="callable"):
        state.register_reset_callbacks([1])


def run_launcher(args, env, timeout):
    return subprocess.run([sys.executable, "-m", "collectives.run", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_the_launcher_replaces_a_dead_rank_without_touching_the_others(tmp_path):
    """collectives-run --min-np: the launcher serves the store, a rank dies (whichever is
    rank 0 of the first generation), the launcher starts one in its place, the others are
    not restarted (their pids finish), the newcomer gets the state, and all three end with
    the reference's bits."""
    env = job_env(None, tmp_path, ELASTIC_VICTIM=0,
                  ELASTIC_KILL_STEP=KILL_STEP, ELASTIC_STEP_SLEEP=0.1)
    out = run_launcher(["--nproc-per-node", "3", "--min-np", "2", "--max-replacements", "1",
                        "-m", "tests.elastic.programs"], env, 100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "in its place (1 of 1)" in out.stderr
    res = results(tmp_path)
    assert len(res) == 3
    old = [r for r in res.values() if not r["newcomer"]]
    assert len(old) == 2 and all(r["worlds"][0] == [0, 3] for r in old)
    ref = reference(STEPS).tobytes().hex()
    assert all(r["w"] == ref and r["world"] == 3 for r in res.values())
    new = next(r for r in res.values() if r["newcomer"])
    assert new["rank"] == 2


@pytest.mark.timeout(60)
def test_a_lone_launcher_whose_ranks_all_failed_ends_with_their_code(tmp_path):
    """Without --rdzv-endpoint no other launcher can reach this one's store: once its ranks
    have all failed, the job is over, and the launcher says so with the first failure's code
    instead of waiting for other ranks."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    out = run_launcher(["--nproc-per-node", "2", "--min-np", "1", "--max-replacements", "0",
                        str(script)], job_env(None, tmp_path), 50)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "waiting for the job's other ranks" not in out.stderr
    assert "failed with exit code 3" in out.stderr, out.stderr[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,match", [
    (["--min-np", "3", "--max-np", "2"], "--max-np"),
    (["--min-np", "0"], "--min-np must be >= 1"),
    (["--max-replacements", "1"], "needs --min-np"),
    (["--min-np", "1", "--nnodes", "2"], "each host's launcher"),
])
def test_elastic_flags_are_checked(args, match):
    out = run_launcher([*args, "-n", "1", "x.py"], dict(os.environ), 30)
    assert out.returncode == 2 and match in out.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n,victim,transport", [
    (3, 0, "shm"), (3, 2, "tcp"),
    pytest.param(2, 1, "shm", marks=pytest.mark.slow), pytest.param(4, 3, "tcp", marks=pytest.mark.slow)])
def test_ddp_is_rebuilt_on_the_new_group_and_the_sampler_follows_it(tmp_path, n, victim, transport):
    """The DDP recipe: TorchState(model, SGD with momentum), DDP rebuilt by a reset
    callback, torch's DistributedSampler over the new default group. A rank dies in the
    middle of a backward; the survivors' weights and momentum equal the fault-free
    single-process run's bits."""
    pytest.importorskip("torch")
    from tests.elastic.programs import torch_reference
    store = store_server()
    env = job_env(store, tmp_path, COLLECTIVES_ELASTIC_NP=n, ELASTIC_VICTIM=victim,
                  ELASTIC_KILL_STEP=KILL_STEP, COLLECTIVES_TRANSPORT=transport,
                  ELASTIC_PROGRAM="ddp_worker")
    got = finish(start(env, n), 150)
    res = results(tmp_path)
    bad = {pid: out[-3000:] for pid, (rc, out) in got.items() if rc not in (0, -signal.SIGKILL)}
    assert not bad
    assert len(res) == n - 1
    ref = torch_reference(STEPS)
    assert len({r["momentum"] for r in res.values()}) == 1
    for r in res.values():
        assert r["w"] == ref and r["world"] == n - 1 and r["step"] == STEPS
        assert r["built_on"] == [0, 1]  # DDP at the start, and again on generation 1
        assert r["checks_ok"]  # the sampler and torch.distributed saw the new world
    store.close()


KEY = "elastic-test-key"


def _members_of_last_generation(port):
    """The newest generation's member count on the store at ``port`` (0 if none)."""
    client = TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=5),
                      wait_for_workers=False, auth_key=KEY)
    try:
        g = 0
        while client.check([f"elastic/none/gen/{g}"]):
            g += 1
        if g == 0:
            return 0
        return len(json.loads(client.get(f"elastic/none/gen/{g - 1}"))["members"])
    finally:
        client.close()


@pytest.mark.timeout(150)
def test_the_store_moves_to_its_successor_when_the_first_launcher_dies(tmp_path):
    """Two launchers of one job (emulating two hosts), two ranks each; the first serves
    the store, the second its successor. The first launcher is killed with SIGKILL (its
    ranks die with it, through its reaper): the second's ranks move to the successor
    store, form a generation of two, and finish with the reference's bits, unrestarted."""
    from tests.support.ranks import free_port
    p1, p2 = free_port(), free_port()
    env = job_env(None, tmp_path, ELASTIC_STEP_SLEEP=0.25, COLLECTIVES_AUTH_KEY=KEY)
    args = [sys.executable, "-m", "collectives.run", "--nproc-per-node", "2", "--min-np", "1",
            "--rdzv-endpoint", f"127.0.0.1:{p1},127.0.0.1:{p2}", "-m", "tests.elastic.programs"]
    a = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    b = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with __import__("socket").create_connection(("127.0.0.1", p1), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        b = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _members_of_last_generation(p1) == 4:
                    break
            except Exception:  # noqa: BLE001  (not up yet)
                pass
            time.sleep(0.1)
        else:
            a.kill()
            pytest.fail("the four ranks never formed one generation: "
                        + a.communicate()[1].decode()[-2000:])
        a.kill()
        a.wait(10)
        out, err = b.communicate(timeout=90)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert b.returncode == 0, err.decode()[-3000:]
    res = results(tmp_path)
    assert len(res) == 2, err.decode()[-3000:]
    ref = reference(STEPS).tobytes().hex()
    for r in res.values():
        assert r["w"] == ref and r["world"] == 2 and r["step"] == STEPS


def _children(pid):
    """The pids of ``pid``'s children (every thread's)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


@pytest.mark.timeout(150)
def test_a_launcher_whose_ranks_died_keeps_serving_the_successor_store(tmp_path):
    """Four launchers of one job, one rank each: the first serves the store, the second
    its successor, the others none. The second's and the fourth's ranks die: their
    launchers wait for the job, the second still serving. Then the first launcher dies
    with the primary: the third's rank moves to the second's store, trains on alone and
    ends with the reference's bits; the second and the fourth launchers then end with 0
    (the job finished without their ranks)."""
    from tests.support.ranks import free_port
    p1, p2 = free_port(), free_port()
    steps = 200
    env = job_env(None, tmp_path, ELASTIC_STEPS=steps, ELASTIC_STEP_SLEEP=0.1,
                  COLLECTIVES_AUTH_KEY=KEY, COLLECTIVES_ELASTIC_NP=4, ELASTIC_DEBUG_AFTER=60)
    args = [sys.executable, "-m", "collectives.run", "--nproc-per-node", "1", "--min-np", "1",
            "--rdzv-endpoint", f"127.0.0.1:{p1},127.0.0.1:{p2}", "-m", "tests.elastic.programs"]
    launchers = []
    try:
        for _ in range(4):
            launchers.append(subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE))
            time.sleep(1.0)  # the first serves the primary, the second the successor
        a, b, c, d = launchers
        wait_until(lambda: len([m for m in members_log(tmp_path) if m["gen"] == 0]) == 4,
                   "generation 0 of 4", 60)
        pids = {m["pid"] for m in members_log(tmp_path)}
        for launcher in (b, d):
            rank, = pids & set(_children(launcher.pid))
            os.kill(rank, signal.SIGKILL)
        wait_until(lambda: any(m["world"] == 2 for m in members_log(tmp_path)),
                   "a generation of 2", 60)
        a.kill()  # the primary store goes, and the first launcher's rank with it
        a.wait(10)
        err = {}
        for name, p in (("c", c), ("b", b), ("d", d)):
            try:
                err[name] = p.communicate(timeout=90)[1].decode()
            except subprocess.TimeoutExpired:
                p.kill()
                err[name] = p.communicate()[1].decode()
                pytest.fail(f"launcher {name} did not end: {err[name][-3000:]}")
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert c.returncode == 0, err["c"][-3000:] + "\nthe second launcher's output:\n" + err["b"][-2000:]
    for name, p in (("b", b), ("d", d)):
        assert p.returncode == 0, err[name][-3000:]
        assert "the job finished without this launcher's 1 rank(s)" in err[name]
    res = results(tmp_path)
    assert len(res) == 1, err["c"][-3000:]
    r, = res.values()
    assert r["world"] == 1 and r["step"] == steps  # it trained on alone, past the primary
    assert r["w"] == reference(steps).tobytes().hex()


def test_failover_store_moves_to_the_successor_once_and_only_forward():
    """A client of host:port,host:port moves to the successor when the primary's server
    is gone (its connections closed, new ones refused), runs its owner's callback there,
    marks the successor adopted; a process starting afterwards takes the adopted successor,
    and one starting while the primary is merely down does not take an unadopted one."""
    from collectives.store.failover import ADOPTED, FailoverStore
    from collectives.store import StoreServer
    a, b = StoreServer(0, None, "127.0.0.1"), StoreServer(0, None, "127.0.0.1")
    addrs = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
    try:
        st = FailoverStore(addrs, timeout=5)
        moved = []
        st.on_switch.append(lambda: moved.append(st.address))
        st.set("k", b"1")
        assert st.address.endswith(f":{a.port}") and not moved
        a.stop(0)
        st.set("k", b"2")  # on the successor now
        assert moved == [f"127.0.0.1:{b.port}"] and st.get("k") == b"2"
        assert st.check([ADOPTED])
        late = FailoverStore(addrs, timeout=5)  # the primary is gone, the successor adopted
        assert late.address == f"127.0.0.1:{b.port}" and late.get("k") == b"2"
        late.close()
        st.close()
    finally:
        a.stop(0)
        b.stop(0)
    c, d = StoreServer(0, None, "127.0.0.1"), StoreServer(0, None, "127.0.0.1")
    dead = c.port
    c.stop(0)
    try:
        from collectives import DistNetworkError
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError, match="no elastic store answers"):
            FailoverStore(f"127.0.0.1:{dead},127.0.0.1:{d.port}", timeout=2)
        assert time.monotonic() - t0 < 15
    finally:
        d.stop(0)
