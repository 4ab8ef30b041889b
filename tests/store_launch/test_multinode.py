"""Two nodes in one machine: each launcher in its own network namespace (its own address
on a veth pair, no shared loopback) and its own UTS namespace (its own host name).

What a job across machines needs and faked hosts on loopback do not check: each rank
publishes an address its peers on the other node can reach, the launchers meet at the
master's address, ranks on the same node find each other (shared memory) and the nodes
talk over TCP (the hierarchical mode), and a cut link between them makes every rank
raise within the group's timeout. Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN),
iproute2's ``ip`` and util-linux's ``unshare``; skipped otherwise.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.support.ranks import ROOT
from tests.support.requires import skip_unless_required

pytestmark = [pytest.mark.multinode, pytest.mark.faults, pytest.mark.slow]

TARGET = os.path.join(ROOT, "tests", "support", "scripts", "multinode_target.py")
GROUP_TIMEOUT = 4.0  # the target's
GRACE = 8.0
ADDRS = ("10.213.0.1", "10.213.0.2")


def _run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _missing():
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command"
    return None


@pytest.fixture
def nodes():
    """Two network namespaces joined by a veth pair; yields their names."""
    why = _missing()
    if why:
        skip_unless_required("netns", why)
    names = [f"coll-test-{os.getpid()}-{i}" for i in range(2)]
    made = []
    try:
        for ns in names:
            p = _run("ip", "netns", "add", ns)
            if p.returncode:
                skip_unless_required("netns", f"cannot make a network namespace: {p.stderr.strip()}")
            made.append(ns)
        links = [f"ct{os.getpid() % 100000}{c}" for c in "ab"]
        steps = [("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for ns, link, addr in zip(names, links, ADDRS):
            steps += [("ip", "link", "set", link, "netns", ns),
                      ("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link),
                      ("ip", "-n", ns, "link", "set", link, "up"),
                      ("ip", "-n", ns, "link", "set", "lo", "up")]
        steps.append(("ip", "netns", "exec", names[0], "unshare", "--uts", "true"))
        for step in steps:
            p = _run(*step)
            if p.returncode:
                skip_unless_required("netns", f"cannot set up the nodes ({' '.join(step)}): "
                                     f"{p.stderr.strip()}")
        yield list(zip(names, links))
    finally:
        for ns in made:
            _run("ip", "netns", "del", ns)


def start_node(ns, i, launcher_args, mode, directory):
    """Node ``i``'s launcher in namespace ``ns``, named node``i``, 2 ranks."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "COLLECTIVES_HOST_ID", "COLLECTIVES_TRANSPORT", "COLLECTIVES_IFNAME",
                        "GLOO_SOCKET_IFNAME")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    launcher = [sys.executable, "-m", "collectives.run", "--nnodes", "2", "-n", "2"]
    script = f'hostname node{i} && exec "$@"'
    cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script, "sh",
           *launcher, *launcher_args(i), TARGET, mode, str(directory)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def results(procs, timeout):
    """Each launcher's exit code and the ranks' RESULT lines."""
    got, codes, outs = {}, [], []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            for q in procs:
                q.kill()
            raise AssertionError("a launcher did not finish:\n" + "\n".join(
                (q.communicate()[0] or "") for q in procs)) from e
        codes.append(p.returncode)
        outs.append(out)
        for line in out.splitlines():
            if "RESULT " in line:
                res = json.loads(line.split("RESULT ", 1)[1])
                got[res["rank"]] = res
    return codes, got, "\n".join(outs)


STATIC = ("static", lambda i: ["--node-rank", str(i), "--master-addr", ADDRS[0],
                               "--master-port", "29517"])
C10D = ("c10d", lambda i: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRS[0]}:29518",
                           "--rdzv-conf", "close_timeout=5,read_timeout=5"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rdzv", [STATIC, C10D], ids=lambda r: r[0])
def test_a_job_on_two_nodes_runs_every_collective(nodes, rdzv, tmp_path):
    procs = [start_node(ns, i, rdzv[1], "check", tmp_path) for i, (ns, _) in enumerate(nodes)]
    codes, got, out = results(procs, 150)
    assert codes == [0, 0], out
    assert sorted(got) == [0, 1, 2, 3], out
    hosts = [got[r]["host"] for r in range(4)]
    assert len(set(hosts)) == 2 and hosts[0] == hosts[1] and hosts[2] == hosts[3], hosts
    for r in range(4):
        assert got[r]["backend"] == "HierarchicalBackend", got[r]
        assert got[r]["bad"] == [], got[r]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rdzv", [STATIC, C10D], ids=lambda r: r[0])
def test_a_cut_link_between_nodes_makes_every_rank_raise_within_the_timeout(nodes, rdzv,
                                                                             tmp_path):
    """No process dies and no connection is reset: the packets stop. Every rank's
    all_reduce raises within the group timeout; the leaders name each other."""
    procs = [start_node(ns, i, rdzv[1], "partition", tmp_path)
             for i, (ns, _) in enumerate(nodes)]
    deadline = time.monotonic() + 90
    while len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) < 4:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError("the job did not start:\n" + "\n".join(
                p.communicate()[0] or "" for p in procs))
        time.sleep(0.05)
    ns, link = nodes[0]
    cut = _run("ip", "-n", ns, "link", "set", link, "down")
    assert cut.returncode == 0, cut.stderr
    codes, got, out = results(procs, GROUP_TIMEOUT + GRACE + 20)
    assert all(codes), out  # both launchers end the job as failed (a rank's code, or 1)
    assert sorted(got) == [0, 1, 2, 3], out
    for r in range(4):
        assert got[r]["raised"] in ("DistBackendError", "DistNetworkError"), got[r]
        assert got[r]["after"] < GROUP_TIMEOUT + GRACE, got[r]
        # a leader times out; a rank waiting on it in shared memory times out too, or
        # sees it exit first
        assert "Timed out" in got[r]["msg"] or "lost (process died)" in got[r]["msg"], got[r]
    # the leaders (ranks 0 and 2) wait for each other across the cut
    assert "rank 2" in got[0]["msg"] and "rank 0" in got[2]["msg"], (got[0], got[2])
