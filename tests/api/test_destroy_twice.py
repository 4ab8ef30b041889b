"""destroy_process_group() with no default group raises, as torch 2.13's does: an
AssertionError "Process group cannot be None" (ours is a ValueError too)."""
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.requires import needs_gloo

SCRIPT = r"""
import sys
which = sys.argv[1]
if which == "torch":
    import torch.distributed as dist
    store = dist.HashStore()
else:
    import collectives as dist
    store = dist.HashStore()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dist.destroy_process_group()
for _ in range(2):  # once destroyed, and again
    try:
        dist.destroy_process_group()
    except AssertionError as e:
        print(type(e).__name__, isinstance(e, ValueError), str(e).split(":")[0])
    else:
        print("no error")
"""


def _run(which):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", SCRIPT, which], capture_output=True, text=True,
                         cwd=ROOT, timeout=100, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@needs_gloo
@pytest.mark.timeout(120)
def test_destroying_the_default_group_twice_raises_as_torch_does():
    lines = _run("collectives")
    assert lines == ["NoDefaultGroupError True Process group cannot be None"] * 2, lines
    pytest.importorskip("torch")
    assert [ln.split()[2:] for ln in _run("torch")] == [["Process", "group", "cannot", "be", "None"]] * 2
