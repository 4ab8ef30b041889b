"""collectives.core.heap: a process's first group fixes glibc's malloc thresholds, so that
memory a loop frees and requests again is reused instead of faulted in every time.

Each case runs in a fresh interpreter (the change is process-wide and cannot be undone):
- a loop that frees and requests 3 x 10 MiB faults about a thousand pages an iteration
  under glibc's own thresholds, and none once a group exists;
- ``COLLECTIVES_MALLOC_TRIM=0``, or a ``MALLOC_*_`` variable the user set, leaves glibc
  alone (the loop still faults);
- the decision without a process (what counts as the user tuning malloc).
"""
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from tests.support import ROOT
from tests.support.requires import needs_gloo

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

_SCRIPT = textwrap.dedent("""
    import json, resource, sys, tempfile, os
    import numpy as np
    import collectives as dist
    from collectives.core import heap

    def faults():  # minor faults of iterations 3-6 of: 3 x 10 MiB requested, touched, freed
        out = []
        for i in range(6):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [np.ones(10 * 2 ** 20 // 8) for _ in range(3)]
            del blocks
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        return sum(out[2:])

    before = faults()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "f"),
                                rank=0, world_size=1)
        after = faults()
        dist.destroy_process_group()
    print(json.dumps({"before": before, "after": after, "state": heap.state}))
""")


def _run(**env):
    e = {k: v for k, v in os.environ.items()
         if not (k.startswith("MALLOC_") or k == "COLLECTIVES_MALLOC_TRIM")}
    e.update(env)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=e, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
@needs_gloo
@pytest.mark.timeout(150)
def test_after_the_first_group_freed_memory_is_reused_not_faulted_again():
    r = _run()
    assert r["state"] == "set"
    # 4 iterations: glibc hands back the free top beyond twice its (raised) threshold each
    # time, and faults it in again (about 1,000 pages an iteration on glibc 2.36)
    assert r["before"] > 2000, r
    assert r["after"] < 200, r


@glibc
@needs_gloo
@pytest.mark.timeout(150)
@pytest.mark.parametrize("env", [{"COLLECTIVES_MALLOC_TRIM": "0"},
                                 {"MALLOC_TOP_PAD_": "131072"}])
def test_the_setting_at_zero_or_the_users_own_malloc_tuning_leave_glibc_alone(env):
    r = _run(**env)
    assert r["state"] == ("off" if "COLLECTIVES_MALLOC_TRIM" in env else "environment")
    assert r["after"] > 2000, r


def test_what_counts_as_the_user_tuning_malloc():
    from collectives.core import heap
    assert heap._user_tunes_malloc({"MALLOC_TRIM_THRESHOLD_": "1"})
    assert heap._user_tunes_malloc({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert not heap._user_tunes_malloc({"GLIBC_TUNABLES": "glibc.rtld.nns=2"})
    assert not heap._user_tunes_malloc({"MALLOC_ARENA_MAX": "2", "OTHER_": "1"})
