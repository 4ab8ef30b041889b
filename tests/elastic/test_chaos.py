"""The chaos check: 8 ranks on 4 emulated hosts (network namespaces on a bridge, as
bench/netlab.py builds them), one collectives-run per host, the store in host 0's
launcher with its successor in host 1's. While the job trains with collectives.elastic,
four ranks die: the current rank 0, then host 0's launcher with the store (its other
ranks die with it, through its reaper), then ranks of the other hosts until four are
gone; two newcomers join from new launchers on hosts 2 and 3. The job must finish with
no survivor restarted (their pids are the ones that started) and the parameters of the
fault-free run (the training is exact, see tests/elastic/programs.py, so every membership
schedule replays to the same bits). Needs root, ``ip`` and ``unshare``; skipped otherwise.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.elastic.programs import members_log, reference, wait_until
from tests.support.ranks import ROOT
from tests.support.requires import needs_gloo

# the elastic groups run on gloo
pytestmark = [pytest.mark.multinode, pytest.mark.faults, pytest.mark.slow, needs_gloo]

STEPS = 300
PORT = 29561
KEY = "elastic-chaos-key"


def _lab():
    sys.path.insert(0, ROOT)
    from bench import netlab
    why = netlab.missing() or (None if __import__("shutil").which("unshare") else
                               "needs the 'unshare' command")
    if why:
        pytest.skip(why)
    return netlab


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (its launcher has not reaped it yet) is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(400)
def test_four_deaths_two_newcomers_on_four_hosts(tmp_path):
    netlab = _lab()
    rng = random.Random(os.getpid())
    out = str(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "COLLECTIVES_HOST_ID", "COLLECTIVES_TRANSPORT", "COLLECTIVES_IFNAME")}
    env.update(PYTHONPATH=ROOT, ELASTIC_OUT=out, ELASTIC_STEPS=str(STEPS),
               ELASTIC_STEP_SLEEP="0.1", ELASTIC_TIMEOUT="20", COLLECTIVES_AUTH_KEY=KEY,
               COLLECTIVES_ELASTIC_NP="8", COLLECTIVES_ELASTIC_TIMEOUT="60",
               ELASTIC_DEBUG_AFTER="300")
    with netlab.Lab(4, rate="10gbit", tag=f"ec{os.getpid() % 10000}") as lab:
        endpoint = f"{lab.addr(0)}:{PORT},{lab.addr(1)}:{PORT}"

        def launcher(i, n):
            return lab.popen(i, [sys.executable, "-m", "collectives.run", "-n", str(n),
                                 "--min-np", "2", "--rdzv-endpoint", endpoint,
                                 "-m", "tests.elastic.programs"], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        launchers = []

        def outputs():
            for p in launchers:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            return "\n---\n".join((p.communicate()[0] or "")[-3000:] for p in launchers)

        try:
            return _chaos(lab, launchers, launcher, out, rng)
        except AssertionError as e:
            raise AssertionError(f"{e}\nlaunchers' output:\n{outputs()}") from None


def _chaos(lab, launchers, launcher, out, rng):
    launchers.append(launcher(0, 2))
    time.sleep(1.0)  # host 0 serves the primary store
    launchers.extend(launcher(i, 2) for i in (1, 2, 3))
    first = wait_until(lambda: [m for m in members_log(out) if m["gen"] == 0] if len(
        [m for m in members_log(out) if m["gen"] == 0]) == 8 else None, "generation 0 of 8", 120)
    started = {m["pid"]: m["host"] for m in first}
    dead = set()

    def next_gen(after):
        return wait_until(lambda: max((m["gen"] for m in members_log(out)), default=-1) > after
                          and max(m["gen"] for m in members_log(out)), f"a generation after {after}")

    def current():
        gen = max(m["gen"] for m in members_log(out))
        return gen, [m for m in members_log(out) if m["gen"] == gen]

    # 1. the current rank 0
    gen, members = current()
    r0 = next(m for m in members if m["rank"] == 0)
    os.kill(r0["pid"], signal.SIGKILL)
    dead.add(r0["pid"])
    gen = next_gen(gen)
    # 2. host 0's launcher, the primary store with it, and its ranks (its reaper)
    host0 = lab.names[0]
    launchers[0].kill()
    for pid, host in started.items():
        if host == host0:
            dead.add(pid)
    wait_until(lambda: not any(_alive(p) for p in dead), "host 0's ranks to die", 30)
    gen = next_gen(gen)
    # 3. more ranks elsewhere until four are dead
    while len(dead) < 4:
        gen, members = current()
        pick = rng.choice([m for m in members if m["pid"] in started and m["pid"] not in dead])
        os.kill(pick["pid"], signal.SIGKILL)
        dead.add(pick["pid"])
        gen = next_gen(gen)
    # 4. two newcomers, from new launchers on hosts 2 and 3
    launchers.extend([launcher(2, 1), launcher(3, 1)])
    outs = []
    for p in launchers:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    text = "\n".join(o or "" for o in outs)
    codes = [p.returncode for p in launchers]
    assert len(dead) >= 4
    assert all(c == 0 for c in codes[1:]), f"launchers ended with {codes}:\n{text[-6000:]}"
    res = {}
    for name in os.listdir(out):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                r = json.load(f)
            res[r["pid"]] = r
    survivors = set(started) - dead
    assert survivors <= set(res), "a survivor did not finish (or was restarted)"
    newcomers = [r for r in res.values() if r["newcomer"]]
    assert len(newcomers) == 2, text[-6000:]
    assert len(res) == 8 - len(dead) + 2
    ref = reference(STEPS).tobytes().hex()
    for r in res.values():
        assert r["step"] == STEPS and r["world"] == len(res)
        assert r["w"] == ref, f"rank {r['rank']}: parameters differ from the fault-free run"
    # the newcomers are numbered after the survivors, in the order they came
    assert sorted(r["rank"] for r in newcomers) == [len(res) - 2, len(res) - 1]
