"""torch.distributed's backend name "collectives" without importing the bridge.

- ``import collectives`` registers it, with torch imported before or after, without
  importing torch itself: ``torch.distributed.init_process_group("collectives")`` then
  trains a DDP model to torch gloo's weights, bit for bit (2 ranks, started as torchrun
  starts them: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
- torch's ``torch.backends`` entry point registers it at ``import torch``, in a program
  that never imports collectives (the same training, the same weights), without importing
  collectives at ``import torch``: the bridge comes at the first init. There
  ``torch.distributed.new_group`` and a ``DeviceMesh``'s groups are collectives' groups.
- ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off: the name is then unknown to torch.
"""
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.procs import reaped
from tests.support.ranks import free_port
from tests.support.requires import needs_gloo

pytest.importorskip("torch")

SCRIPT = os.path.join(ROOT, "tests", "support", "scripts", "train_by_name.py")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **extra)
    for var in ("COLLECTIVES_TORCH_BRIDGE", "TORCH_DEVICE_BACKEND_AUTOLOAD", "RANK",
                "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        if var not in extra:
            env.pop(var, None)
    return env


def _train(backend, how, world=2, **env):
    """Both ranks' (facts, weights as hex) from a run of train_by_name.py."""
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, SCRIPT, backend, how], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=port, **env)) for r in range(world)]
    out = []
    with reaped(procs):
        for r, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=150)
            assert p.returncode == 0, f"rank {r} ({backend}, {how}) failed:\n{stderr}"
            lines = dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)
            facts = dict(kv.split("=", 1) for kv in lines["FACTS"].split())
            out.append((facts, lines["WEIGHTS"]))
    return out


@pytest.fixture(scope="module")
def gloo_weights():
    runs = _train("gloo", "none")
    assert runs[0][1] == runs[1][1]
    assert runs[0][0]["new_group"] == runs[0][0]["mesh_group"] == "torch"
    return runs[0][1]


def _check_groups(facts):
    """torch.distributed.new_group and a DeviceMesh's groups are collectives' groups."""
    assert facts["new_group"] == "collectives", facts
    assert facts["mesh_group"] == "collectives", facts
    assert facts["mesh_sum"] == "2", facts


@needs_gloo
@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["import-after", "import-before"])
def test_import_collectives_registers_the_name_and_trains_to_gloos_weights(how, gloo_weights):
    # the import hook, not torch's autoload, registers it here
    runs = _train("collectives", how, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    for r, (facts, weights) in enumerate(runs):
        assert facts["backend"] == "collectives"
        assert facts["bridge_before_init"] == "False", "the bridge was imported before init"
        if how == "import-after":
            assert facts["torch_imported_by_collectives"] == "False"
        _check_groups(facts)
        assert weights == gloo_weights, f"rank {r}: weights differ from torch gloo's"


@needs_gloo
@pytest.mark.timeout(400)
def test_torchs_entry_point_registers_the_name_in_a_program_that_never_imports_collectives(
        gloo_weights):
    runs = _train("collectives", "none")
    for r, (facts, weights) in enumerate(runs):
        assert facts["backend"] == "collectives"
        assert facts["collectives_imported_by_torch"] == "False"
        _check_groups(facts)
        assert weights == gloo_weights, f"rank {r}: weights differ from torch gloo's"


PROBE = r"""
import sys
import torch
import torch.distributed as td
print("registered", "collectives" in td.Backend.backend_list, "collectives" in sys.modules)
try:
    td.init_process_group("collectives", store=td.HashStore(), rank=0, world_size=1)
except Exception as e:
    print("refused", type(e).__name__, e)
else:
    print("initialised", td.get_backend())
"""


@needs_gloo  # (the group torch makes by name runs on gloo)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("autoload", ["1", "0"])
def test_torchs_autoload_switch_decides_whether_torch_knows_the_name(autoload):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                         timeout=100, env=_env(TORCH_DEVICE_BACKEND_AUTOLOAD=autoload))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    if autoload == "1":
        assert lines == ["registered True False", "initialised collectives"], out.stdout + out.stderr
    else:
        assert lines[0] == "registered False False", out.stdout
        assert lines[1].startswith("refused") and "collectives" in lines[1], out.stdout


NO_TORCH = r"""
import sys
import collectives
print("torch" in sys.modules, "torch.distributed" in sys.modules)
"""


@pytest.mark.timeout(120)
def test_import_collectives_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                         cwd=ROOT, timeout=100, env=_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
