"""collectives-run starts the ranks with torchrun's environment, keeps their lines whole
and labelled, and never leaves a rank (or a rank's child) behind."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support import ROOT
from tests.support.ranks import free_port
from tests.support.requires import needs_gloo

TARGET = os.path.join(ROOT, "tests", "support", "scripts", "launch_target.py")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def launch(args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "collectives.run"] + args, cwd=ROOT,
                          env=env or _env(), capture_output=True, timeout=timeout)


def start(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "collectives.run"] + args, cwd=ROOT,
                            env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def alive(pid):
    """True if ``pid`` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def pids(directory):
    return {f[:-4]: int(open(os.path.join(directory, f)).read())
            for f in os.listdir(directory) if f.endswith(".pid")}


def wait_for_pids(directory, n, timeout=30):
    deadline = time.monotonic() + timeout
    while len(pids(directory)) < n:
        assert time.monotonic() < deadline, f"only {pids(directory)} started"
        time.sleep(0.02)
    return pids(directory)


def assert_all_gone(pid_map, within=3.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pid_map.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = {k: p for k, p in pid_map.items() if alive(p)}
    for p in left.values():
        os.kill(p, signal.SIGKILL)
    assert not left, f"left running: {left}"


def rank_lines(text):
    return [ln for ln in text.decode().splitlines() if ln]


def rank_json(text):
    """{rank: the JSON object it printed} from a launcher's prefixed output; AssertionError
    for any other line."""
    got = {}
    for line in rank_lines(text):
        m = re.match(r"^\[(\d+)\] (\{.*\})$", line)
        assert m, line
        got[int(m.group(1))] = json.loads(m.group(2))
    return got


# ---- environment ------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_each_rank_gets_torchruns_environment():
    port = free_port()
    out = launch(["--nnodes=2", "--node_rank", "1", "--nproc-per-node", "3",
                  "--master-addr", "10.1.2.3", "--master_port", str(port), "--rdzv-id", "job7",
                  TARGET, "env"])
    assert out.returncode == 0, out.stderr.decode()
    envs = rank_json(out.stdout)
    assert sorted(envs) == [3, 4, 5]
    for rank, e in envs.items():
        assert e == {"RANK": str(rank), "LOCAL_RANK": str(rank - 3), "WORLD_SIZE": "6",
                     "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1", "NODE_RANK": "1",
                     "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": str(port),
                     "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "job7"}


@pytest.mark.timeout(60)
def test_standalone_picks_one_free_port_and_keeps_a_users_omp_setting():
    out = launch(["--standalone", "--nproc_per_node=2", TARGET, "env"], env=_env(OMP_NUM_THREADS="7"))
    assert out.returncode == 0, out.stderr.decode()
    envs = [json.loads(line.split(" ", 1)[1]) for line in rank_lines(out.stdout)]
    assert len(envs) == 2
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1
    # below the ephemeral range: no outgoing connection can take it before rank 0 listens
    from collectives.run import _ephemeral_low
    assert 0 < int(ports.pop()) < _ephemeral_low()
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"7"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}


def test_free_port_is_below_the_ephemeral_range_unused_and_new_each_call():
    import socket

    from collectives.run import _bindable, _ephemeral_low
    from collectives.run import free_port as pick
    ports = [pick() for _ in range(5)]
    assert len(set(ports)) == 5
    assert all(0 < p < _ephemeral_low() and _bindable(p) for p in ports)
    with socket.create_server(("127.0.0.1", ports[0])):  # someone listens there now
        assert not _bindable(ports[0])


@pytest.mark.timeout(60)
def test_ranks_rendezvous_through_the_launchers_environment():
    out = launch(["-n", "3", TARGET, "rdzv"])
    assert out.returncode == 0, out.stderr.decode()
    assert sorted(rank_lines(out.stdout)) == [f"[{r}] rank {r} of 3 read [0, 1, 4]" for r in range(3)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchrun_starts_a_collectives_program():
    """A program that imports collectives as dist, launched by torch's own torchrun (whose
    agent holds MASTER_PORT): its group forms, works, and forms again after a destroy; and
    again after a rank fails and torchrun restarts them all (the agent's store outlives
    the first workers, with their keys)."""
    pytest.importorskip("torch.distributed.run")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                          "--max-restarts", "1", TARGET, "group", "fail-once"], cwd=ROOT,
                         env=_env(), capture_output=True, timeout=100)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    lines = rank_lines(out.stdout)
    assert "restart 0 rank 1 of 3 attempt 0 sum [6, 6, 6]" in lines
    assert sorted(ln for ln in lines if ln.startswith("restart 1 ")) == sorted(
        f"restart 1 rank {r} of 3 attempt {a} sum {[6 + 3 * a] * 3}"
        for r in range(3) for a in range(2))


@pytest.mark.timeout(60)
def test_module_and_no_python_forms():
    out = launch(["--nproc-per-node", "2", "-m", "tests.support.scripts.launch_target", "env"])
    assert out.returncode == 0, out.stderr.decode()
    assert len(rank_lines(out.stdout)) == 2
    out = launch(["--nproc-per-node", "2", "--no-python", "--no-prefix", "sh", "-c", "echo rank=$RANK"])
    assert out.returncode == 0, out.stderr.decode()
    assert sorted(rank_lines(out.stdout)) == ["rank=0", "rank=1"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,match", [
    (["--nnodes", "1:2"], "elastic node range needs --rdzv-backend c10d"),
    (["--nnodes", "2:1"], "MIN <= MAX"),
    (["--rdzv-backend", "etcd"], "--rdzv-backend must be one of static, c10d"),
    (["--rdzv-backend", "c10d"], "needs --rdzv-endpoint"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:x"], "host[:port]"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0", "--nnodes", "1:2"], "one node only"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "join_timeout=-1"],
     "join_timeout must be >= 0"),
    (["--nproc-per-node", "0"], "nproc-per-node"),
    (["--nnodes", "2", "--node-rank", "2"], "node-rank"),
    (["--nnodes", "2", "--master-port", "0"], "master-port"),
    (["-m", "--no-python"], "--no-python"),
])
def test_bad_flags_are_usage_errors(args, match):
    out = launch(args + [TARGET, "env"])
    assert out.returncode == 2
    assert match in out.stderr.decode()


# ---- output ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_every_line_is_whole_and_labelled_with_its_rank():
    n = 300
    out = launch(["--nproc-per-node", "4", TARGET, "lines", str(n)])
    assert out.returncode == 0, out.stderr.decode()
    counts = {r: 0 for r in range(4)}
    tails = set()
    for line in rank_lines(out.stdout):
        m = re.match(r"^\[(\d)\] line (\d+) of rank (\d) end$", line)
        if m is None:
            m2 = re.match(r"^\[(\d)\] no newline at the end from (\d)$", line)
            assert m2 and m2.group(1) == m2.group(2), f"torn or unlabelled line: {line!r}"
            tails.add(int(m2.group(1)))
            continue
        assert m.group(1) == m.group(3)
        counts[int(m.group(1))] += 1
    assert counts == {r: n for r in range(4)}
    assert tails == {0, 1, 2, 3}
    err = rank_lines(out.stderr)
    assert len(err) == 4 * len(range(0, n, 50))
    assert all(re.match(r"^\[(\d)\] err \d+ of rank \1$", ln) for ln in err)


@pytest.mark.timeout(60)
def test_no_prefix_keeps_lines_whole():
    out = launch(["--nproc-per-node", "3", "--no_prefix", TARGET, "lines", "100"])
    assert out.returncode == 0
    lines = [ln for ln in rank_lines(out.stdout) if not ln.startswith("no newline")]
    assert len(lines) == 300
    assert all(re.match(r"^line \d+ of rank \d end$", ln) for ln in lines)


@pytest.mark.timeout(60)
def test_rank_0_reads_stdin_and_an_unfinished_prompt_is_written():
    out = subprocess.run([sys.executable, "-m", "collectives.run", "-n", "2", TARGET, "prompt"],
                         cwd=ROOT, env=_env(), input=b"yes\nmore\n", capture_output=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    lines = rank_lines(out.stdout)
    for r in range(2):  # the prompt came out on its own, before the answer
        mine = [ln for ln in lines if ln.startswith(f"[{r}] ")]
        assert mine == [f"[{r}] rank {r} asks> ",
                        f"[{r}] rank {r} read {'yes' if r == 0 else ''!r}"], lines


# ---- failures and signals ------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_failing_rank_stops_the_others_and_is_reported(tmp_path):
    t0 = time.monotonic()
    out = launch(["--nproc-per-node", "3", TARGET, "fail", str(tmp_path)], timeout=30)
    elapsed = time.monotonic() - t0
    assert out.returncode == 3
    assert elapsed < 5, elapsed
    assert_all_gone(pids(tmp_path), within=0.5)  # ranks and their children
    err = out.stderr.decode()
    assert re.search(r"rank 1 .*failed with exit code 3", err), err
    assert "bye from rank 1" in err.split("failed with exit code 3", 1)[1]
    assert len(pids(tmp_path)) == 6


FAIL_AFTER_INIT = """
import torch  # noqa: F401  (torch's init_process_group prefixes a traceback's lines)
import collectives as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("boom on rank 1")
dist.barrier()
"""


@needs_gloo  # its program's init_process_group("gloo")
@pytest.mark.timeout(120)
def test_a_failed_ranks_traceback_is_printed_once_with_one_prefix(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "fail.py"
    script.write_text(FAIL_AFTER_INIT)
    out = launch(["--nproc-per-node", "2", str(script)], timeout=100)
    assert out.returncode == 1
    err = out.stderr.decode()
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "[1] Traceback (most recent call last)" in err, err
    assert "[rank1]" not in err, err
    assert "its last line: RuntimeError: boom on rank 1" in err, err


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_a_rank_that_ignores_sigterm_is_killed(tmp_path):
    t0 = time.monotonic()
    out = launch(["--nproc-per-node", "3", "--term-timeout", "1", TARGET, "stubborn", str(tmp_path)],
                 timeout=30)
    assert out.returncode == 3
    assert time.monotonic() - t0 < 6
    assert_all_gone(pids(tmp_path), within=0.5)
    assert "rank 0" in out.stderr.decode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path, sig):
    proc = start(["--nproc-per-node", "3", TARGET, "sleep", str(tmp_path)])
    try:
        started = wait_for_pids(tmp_path, 6)
        time.sleep(0.2)  # the ranks are past their startup, sleeping
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert time.monotonic() - t0 < 5
        assert proc.returncode == 128 + sig
        assert_all_gone(started, within=0.5)
        if sig == signal.SIGINT:
            assert sorted(rank_lines(out)) == [f"[{r}] rank {r} got KeyboardInterrupt" for r in range(3)]
        assert signal.Signals(sig).name in err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_max_restarts_reruns_every_rank_after_a_failure(tmp_path):
    script = 'test "$TORCHELASTIC_RESTART_COUNT" = 1 || exit 5; echo ok $RANK'
    out = launch(["-n", "2", "--max-restarts", "1", "--log-dir", str(tmp_path),
                  "--no-python", "sh", "-c", script])
    assert out.returncode == 0, out.stderr.decode()
    assert sorted(rank_lines(out.stdout)) == ["[0] ok 0", "[1] ok 1"]
    assert "exit code 5" in out.stderr.decode() and "restarting" in out.stderr.decode()
    assert open(tmp_path / "rank1.out").read() == "ok 1\n"
    out = launch(["-n", "2", "--max-restarts", "1", "--no-python", "sh", "-c", "exit 5"])
    assert out.returncode == 5


# ---- the c10d rendezvous: launchers that number their nodes themselves -----------------

def launch_nodes(n, args, delays=None, timeout=90, per_node=None):
    """``n`` launchers on this machine as ``n`` nodes (each its own faked host), with
    ``--rdzv-backend c10d`` at a free port and ``args``; launcher i starts after
    ``delays[i]`` seconds, with ``per_node[i]`` before ``args``. Returns [(returncode,
    {rank: its JSON line}, stderr)] per launcher (the ranks print only JSON lines)."""
    port = free_port()
    job = f"job-{os.getpid()}-{port}"  # launchers of another job never count as this one's
    procs = []
    t0 = time.monotonic()
    for i in range(n):
        if delays:
            time.sleep(max(0.0, t0 + delays[i] - time.monotonic()))
        procs.append(start(["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                            "--rdzv-id", job] + (per_node[i] if per_node else []) + args,
                           env=_env(COLLECTIVES_HOST_ID=f"node-{i}")))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in hung:
        procs[i].kill()
    ended = [(out, err, p.returncode) for p in procs for out, err in [p.communicate()]]
    assert not hung, f"launchers {hung} still ran after {timeout} s:\n" + "\n".join(
        f"--- launcher {i} (exit {rc}):\n{err.decode()}" for i, (_, err, rc) in enumerate(ended))
    return [(rc, rank_json(out), err.decode()) for out, err, rc in ended]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_c10d_launchers_number_their_nodes_without_node_rank():
    got = launch_nodes(3, ["--nnodes", "3", "-n", "2", "--rdzv-conf", "close_timeout=5",
                           TARGET, "elastic"])
    seen = {}
    for rc, lines, err in got:
        assert rc == 0, err
        assert len(lines) == 2, err
        for r, d in lines.items():
            seen[r] = d
    assert sorted(seen) == list(range(6))
    nodes = sorted({d["node"] for d in seen.values()})
    assert nodes == [0, 1, 2]
    for r, d in seen.items():
        assert d["rank"] == r == d["node"] * 2 + d["local"]
        assert (d["world"], d["nodes"], d["restart"], d["sum"]) == (6, 3, 0, 21)
    # the launcher that serves the store (the first to bind the endpoint) is node 0
    assert any("node 0 of 3 (round 0)" in err for _, _, err in got)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_c10d_nodes_may_start_different_numbers_of_ranks():
    got = launch_nodes(2, ["--nnodes", "2", "--rdzv-conf", "close_timeout=5", TARGET, "elastic"],
                       per_node=[["-n", "1"], ["-n", "2"]])
    seen = {}
    for rc, lines, err in got:
        assert rc == 0, err
        seen.update(lines)
    assert sorted(seen) == [0, 1, 2]
    for r, d in seen.items():
        assert (d["rank"], d["world"], d["sum"]) == (r, 3, 6)
    # node ranks in join order; each node's ranks follow the previous nodes' ones
    assert [r for _, _, r in sorted((d["node"], d["local"], r) for r, d in seen.items())] \
        == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_c10d_a_failure_restarts_every_node_while_max_restarts_allows():
    got = launch_nodes(2, ["--nnodes", "2", "-n", "1", "--max-restarts", "1",
                           "--rdzv-conf", "close_timeout=5", TARGET, "elastic",
                           "fail-node1-once"])
    for rc, lines, err in got:
        assert rc == 0, err
        assert "restarting every rank (1 of 1): rank 1 on node 1 failed with exit code 7" in err
        [d] = lines.values()
        assert (d["world"], d["restart"], d["sum"]) == (2, 1, 3)
    got = launch_nodes(2, ["--nnodes", "2", "-n", "1", "--rdzv-conf", "close_timeout=5",
                           TARGET, "elastic", "fail-node1-once"])
    codes = sorted(rc for rc, _, _ in got)
    assert codes == [1, 7], got  # node 1 with its rank's code, node 0 with 1
    assert any("stopping: rank 1 on node 1 failed with exit code 7; no restart left" in err
               for _, _, err in got), got


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_c10d_elastic_range_starts_with_min_and_takes_a_late_node_in():
    # MIN 1, MAX 2: the first node runs alone after last_call_timeout; the second joins
    # 4 s later and both restart in a round of two (not counted as a restart)
    args = ["--nnodes", "1:2", "-n", "1", "--rdzv-conf",
            "last_call_timeout=1,close_timeout=5", TARGET, "elastic", "want-nodes", "2"]
    got = launch_nodes(2, args, delays=[0, 4])
    first, second = got
    assert first[0] == 0 and second[0] == 0, got
    assert "node 0 of 1 (round 0)" in first[2]
    assert "restarting every rank in a new round: a node joined" in first[2]
    assert "node 1 of 2 (round 1)" in second[2]
    for _, lines, _ in got:
        [d] = lines.values()
        assert (d["world"], d["nodes"], d["restart"], d["sum"]) == (2, 2, 0, 3)


@pytest.mark.timeout(60)
@needs_gloo
def test_c10d_on_one_node_with_port_0_as_torchrun_is_often_run():
    out = launch(["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1",
                  "--nproc-per-node=2", TARGET, "elastic"])
    assert out.returncode == 0, out.stderr.decode()
    got = rank_json(out.stdout).values()
    assert sorted((d["rank"], d["world"], d["sum"]) for d in got) == [(0, 2, 3), (1, 2, 3)]


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_c10d_too_few_nodes_fail_after_join_timeout():
    got = launch_nodes(1, ["--nnodes", "2", "-n", "1", "--rdzv-conf",
                           "join_timeout=1,close_timeout=0", TARGET, "elastic"])
    rc, lines, err = got[0]
    assert rc == 1 and not lines, err
    assert "only 1 of at least 2 nodes joined the rendezvous within join_timeout=1 s" in err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_c10d_a_signal_ends_launchers_waiting_for_nodes():
    port = free_port()
    args = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
            f"job-{os.getpid()}-{port}", "--rdzv-conf", "close_timeout=0", TARGET, "elastic"]

    def interrupted(p):
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
        return p.returncode, time.monotonic() - t0, err.decode()

    # node 0 alone, waiting for a second node
    host = start(["--nnodes", "2"] + args)
    time.sleep(2)
    rc, took, err = interrupted(host)
    assert rc == 130 and took < 5 and "stopped by a signal" in err, (rc, took, err)
    # node 0 and node 1 waiting for a third: node 1 stops, and so does node 0
    host = start(["--nnodes", "3"] + args, env=_env(COLLECTIVES_HOST_ID="node-0"))
    time.sleep(1)
    client = start(["--nnodes", "3"] + args, env=_env(COLLECTIVES_HOST_ID="node-1"))
    time.sleep(2)
    rc, took, err = interrupted(client)
    assert rc == 130 and took < 5 and "stopped by a signal" in err, (rc, took, err)
    out, err = host.communicate(timeout=20)
    assert host.returncode == 1 and "received SIGINT" in err.decode(), err.decode()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["read_timeout", "signal"])
def test_c10d_a_silent_store_ends_the_other_nodes_part(tmp_path, ending):
    """Node 0's launcher (the rendezvous store) frozen mid-job, as a crashed host or a cut
    network leaves it: no connection is reset, no answer comes. Node 1's launcher stops
    its ranks and exits read_timeout after the last answer; a signal that comes meanwhile
    ends it within one request's wait (it relays its ranks' output all along)."""
    port = free_port()
    read_timeout = 3 if ending == "read_timeout" else 60
    args = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
            f"job-{os.getpid()}-{port}", "--nnodes", "2", "-n", "1", "--rdzv-conf",
            f"close_timeout=1,read_timeout={read_timeout}", TARGET, "sleep", str(tmp_path)]
    host = start(args, env=_env(COLLECTIVES_HOST_ID="node-0"))
    time.sleep(1)  # the first launcher serves the store
    client = start(args, env=_env(COLLECTIVES_HOST_ID="node-1"))
    try:
        ranks = wait_for_pids(tmp_path, 4)  # two ranks and a child of each
        os.kill(host.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        if ending == "signal":
            time.sleep(1.0)
            client.send_signal(signal.SIGTERM)
        out, err = client.communicate(timeout=30)
        took = time.monotonic() - t0
        err = err.decode()
        if ending == "read_timeout":
            assert client.returncode == 1, err
            assert "no answer within read_timeout=3 s" in err, err
            assert 2.5 < took < 3 + 5 + 3, (took, err)  # + a request's wait + term_timeout
        else:
            assert client.returncode == 128 + signal.SIGTERM, err
            assert took < 1 + 5 + 3, (took, err)
        assert_all_gone({k: v for k, v in ranks.items() if k.endswith("1")})
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.send_signal(signal.SIGTERM)
        host.communicate(timeout=30)
        client.kill()
        client.communicate()
    assert_all_gone(ranks)


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_a_launcher_killed_by_sigkill_leaves_no_rank_behind(tmp_path):
    """SIGKILL gives the launcher no chance to clean up: its reaper process kills every
    rank's process group (the ranks and their children) once the launcher is gone."""
    launcher = start(["-n", "2", TARGET, "sleep", str(tmp_path)])
    try:
        ranks = wait_for_pids(tmp_path, 4)  # two ranks and a child of each
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.communicate(timeout=10)
        assert_all_gone(ranks, within=5.0)
    finally:
        launcher.kill()
        launcher.communicate()
