"""What a group is does not depend on when torch was imported: init_process_group decides,
once, whether the world's groups are torch ProcessGroups too (torch already imported and
COLLECTIVES_TORCH_BRIDGE not 0), and every group of that world follows."""
import os
import subprocess
import sys

import pytest

from tests.support.ranks import ROOT, free_port
from tests.support.requires import needs_gloo

pytestmark = needs_gloo  # the worlds are gloo's

pytest.importorskip("torch")

SCRIPT = r"""
import sys
torch_first = sys.argv[1] == "1"
if torch_first:
    import torch  # noqa: F401
import collectives as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
before = dist.new_group([0])
import torch  # noqa: F401,E402
after = dist.new_group([0])
if sys.argv[3] == "1":  # torch is hooked in after init: the groups made from then on bridge
    import collectives.torch_bridge.torch_pg as tp
    assert tp.install_default(dist.group.WORLD) or torch_first
    after = dist.new_group([0])
world = dist.group.WORLD
import torch.distributed as td  # noqa: E402
print(type(world).__name__, type(before).__name__, type(after).__name__,
      isinstance(after, td.ProcessGroup), td.is_initialized())
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
# quick: torch imported after init, then the bridge installed (both kinds of group in one run)
@pytest.mark.parametrize("torch_first,install,expect", [
    pytest.param(True, False, ("BridgedGroup", "BridgedGroup", "BridgedGroup", "True", "True"),
                 marks=pytest.mark.slow),
    pytest.param(False, False, ("ProcessGroup", "ProcessGroup", "ProcessGroup", "False", "False"),
                 marks=pytest.mark.slow),
    (False, True, ("ProcessGroup", "ProcessGroup", "BridgedGroup", "True", "True")),
], ids=["torch-before-init", "torch-after-init", "torch-after-init-then-installed"])
def test_every_group_of_a_world_is_of_the_kind_decided_at_init(torch_first, install, expect):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("COLLECTIVES_TORCH_BRIDGE", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if torch_first else "0", str(free_port()),
                          "1" if install else "0"],
                         capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert tuple(out.stdout.split()) == expect, out.stdout + out.stderr
