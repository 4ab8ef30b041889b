"""Waiting is never silent, and a disagreement at the rendezvous is named.

- A rank blocked in a collective longer than COLLECTIVES_WAIT_WARN_S logs a warning that
  names the collective (its call and number) and the ranks that have not arrived, then
  again at doubling intervals; 0 turns it off. The same at the rendezvous (env://), for
  the ranks that have not arrived there.
- Ranks started with different world sizes (WORLD_SIZE 2 on one, 3 on the other) raise
  on every rank within the rendezvous timeout, naming which rank said which size.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.support import ROOT
from tests.support.procs import reaped
from tests.support.ranks import free_port
from tests.support.requires import needs_gloo

pytestmark = needs_gloo

LATE = r"""
import os, sys, time
import numpy as np
import collectives as dist
from datetime import timedelta
rank, where, delay = int(os.environ["RANK"]), sys.argv[1], float(sys.argv[2])
if rank == 1 and where == "rendezvous":
    time.sleep(delay)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
if rank == 1 and where == "all_reduce":
    time.sleep(delay)
x = np.ones(4, dtype=np.float32)
dist.all_reduce(x)
assert x.tolist() == [2.0] * 4
dist.destroy_process_group()
print("done")
"""


def _ranks(code, args, envs, timeout=120):
    """Start one process per environment in ``envs``; [(returncode, stdout, stderr, seconds)]."""
    port = str(free_port())
    t0 = time.monotonic()
    procs = []
    for extra in envs:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    with reaped(procs):
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr, time.monotonic() - t0))
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["all_reduce", "rendezvous"])
def test_a_rank_that_arrives_late_makes_the_others_say_who_they_wait_for(where):
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "COLLECTIVES_WAIT_WARN_S": "1"} for r in range(2)]
    runs = _ranks(LATE, [where, "5"], envs)
    for r, (rc, out, err, _) in enumerate(runs):
        assert rc == 0 and "done" in out, f"rank {r}:\n{err}"
    lines = [ln for ln in runs[0][2].splitlines() if "has waited" in ln]
    # at 1, 2 and 4 s of the 5 (doubling; 8 and 16 where the late rank's own start is slow
    # on a loaded machine), not once per half-second tick
    assert 2 <= len(lines) <= 5, runs[0][2]
    for ln in lines:
        assert "ranks {1} have not arrived" in ln, ln
        if where == "all_reduce":
            m = re.search(r"in all_reduce\(float32, 4[^)]*\) #(\d+) in group", ln)
            assert m, ln
        else:
            assert "at the rendezvous" in ln, ln
    if where == "all_reduce":
        assert len({re.search(r"#(\d+)", ln).group(1) for ln in lines}) == 1, lines
    assert "has waited" not in runs[1][2], runs[1][2]  # the late one waited for nobody


@pytest.mark.timeout(200)
def test_the_warning_is_off_at_zero():
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "COLLECTIVES_WAIT_WARN_S": "0"} for r in range(2)]
    runs = _ranks(LATE, ["all_reduce", "3"], envs)
    for r, (rc, out, err, _) in enumerate(runs):
        assert rc == 0 and "done" in out, f"rank {r}:\n{err}"
        assert "has waited" not in err, err


MISMATCH = r"""
import collectives as dist
from datetime import timedelta
try:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
except ValueError as e:
    print("ValueError:", e)
else:
    print("initialised", dist.get_world_size())
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)], ids=["rank0-says-2", "rank0-says-3"])
def test_a_world_size_disagreement_raises_on_every_rank_naming_both_sizes(sizes):
    envs = [{"RANK": str(r), "WORLD_SIZE": str(n)} for r, n in enumerate(sizes)]
    runs = _ranks(MISMATCH, [], envs)
    for r, (rc, out, err, secs) in enumerate(runs):
        assert rc == 0, err
        assert out.startswith("ValueError:"), f"rank {r}: {out}{err}"
        assert "disagree" in out, out
        assert f"rank 0 has world_size={sizes[0]}" in out, out
        assert f"rank 1 has world_size={sizes[1]}" in out, out
        assert secs < 30, f"rank {r} raised after {secs:.0f} s, past the rendezvous timeout"


@pytest.mark.timeout(200)
def test_two_processes_with_one_rank_raise_on_every_rank():
    envs = [{"RANK": str(r), "WORLD_SIZE": "3"} for r in (0, 1, 1)]
    runs = _ranks(MISMATCH, [], envs)
    for r, (rc, out, err, secs) in enumerate(runs):
        assert rc == 0, err
        assert out.startswith("ValueError:") and "two processes have rank 1" in out, out
        assert secs < 30, f"process {r} raised after {secs:.0f} s"


SKIP_ONE = r"""
import os, time
import numpy as np
import collectives as dist
from datetime import timedelta
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=2))
x = np.ones(4, dtype=np.float32)
dist.broadcast(x, src=0)
if rank == 0:
    try:
        dist.all_reduce(x)
    except dist.DistError as e:
        print("DistError:", e)
else:
    time.sleep(6)  # never calls all_reduce
"""


@pytest.mark.timeout(200)
def test_a_timeout_names_the_collectives_number_as_the_user_counts_calls():
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "COLLECTIVES_WAIT_WARN_S": "0"} for r in range(2)]
    runs = _ranks(SKIP_ONE, [], envs)
    out = runs[0][1]
    assert out.startswith("DistError:"), runs[0][1] + runs[0][2]
    # the flight recorder's number and the backend's agree: the second call
    assert "all_reduce(float32, 4, op=SUM) #2" in out, out
    assert "sequence" not in out, out
    assert re.search(r"all_reduce \(collective #2\) failed on rank 0", out), out
