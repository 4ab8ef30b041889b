"""The parts a run must have are there: a missing one fails the run, it does not skip away.

Without mpi4py, every mpi-configured test drops out of the run; without Debian's Slurm,
the Slurm cluster tests skip; without root, the network-namespace tests skip. A run (each
.ci/run leg) lists the parts it must have in COLLECTIVES_TEST_REQUIRE (comma-separated,
from tests/support/requires.py's PARTS); this module checks each listed part works, and
the Slurm and namespace fixtures fail instead of skipping when theirs is listed.
"""
import os
import shutil
import subprocess

import pytest

from tests.support.ranks import backend_pool, config_available
from tests.support.requires import PARTS, required, skip_unless_required

# part -> (configuration, the default group's backend class on it)
POOLED = {"gloo": ("gloo", None), "shm": ("gloo", "ShmBackend"),
          "hier": ("gloo-hier", "HierarchicalBackend"), "mpi": ("mpi", "MpiBackend")}


def backend_class(ctx):
    import numpy as np

    import collectives as dist
    t = np.full(4, ctx.rank + 1.0)
    dist.all_reduce(t)
    return type(dist.distributed_c10d._get_default_group().backend).__name__, float(t[0])


def slurm_missing():
    from tests.store_launch.test_slurm import _slurm_missing
    return _slurm_missing()


def netns_missing():
    from tests.store_launch.test_multinode import _missing
    why = _missing()
    if why:
        return why
    name = f"coll-req-{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if p.returncode:
        return f"cannot make a network namespace: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("part", PARTS)
def test_each_required_part_is_there(part):
    if part in POOLED:
        config, cls = POOLED[part]
        ok, why = config_available(config)
        if not ok:
            skip_unless_required(part, why)
        got = backend_pool(config, 2).run(backend_class, timeout=120)
        assert [v for _, v in got] == [3.0, 3.0], got
        if cls is not None and any(c != cls for c, _ in got):
            skip_unless_required(part, f"the {config} configuration's backend is {got[0][0]}, not {cls}")
    elif part == "slurm":
        why = slurm_missing()
        if why:
            skip_unless_required(part, why)
    else:
        why = netns_missing()
        if why:
            skip_unless_required(part, why)


def test_the_required_list_names_only_known_parts(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TEST_REQUIRE", "gloo, mpi")
    assert required() == ["gloo", "mpi"]
    monkeypatch.setenv("COLLECTIVES_TEST_REQUIRE", "gloo,mpl")
    with pytest.raises(ValueError, match="mpl"):
        required()


def test_a_missing_required_part_fails_and_an_optional_one_skips(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TEST_REQUIRE", "slurm")
    with pytest.raises(pytest.fail.Exception, match="must have slurm"):
        skip_unless_required("slurm", "no slurmctld")
    with pytest.raises(pytest.skip.Exception):
        skip_unless_required("netns", "not root")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ci_requires_every_part_in_its_main_leg():
    """.ci/run lists gloo, shm, hier and mpi for the whole suite, Slurm and namespaces as root."""
    from tests.support import ROOT
    path = os.path.join(ROOT, ".ci", "run")
    if not os.path.exists(path):
        pytest.skip("reads .ci/run, which the installed leg does not copy")
    text = open(path).read()
    assert "COLLECTIVES_TEST_REQUIRE=gloo,shm,hier,mpi" in text
    assert "slurm,netns" in text
