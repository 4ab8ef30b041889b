"""Training frameworks, installed for real (the ``frameworks`` extra), each launching 2 CPU
processes its own way, on collectives: every rank ends with torch gloo's weights, bit for
bit, from the same program run on gloo.

- PyTorch Lightning: ``DDPStrategy(process_group_backend="collectives")`` after a plain
  ``import collectives``; Lightning starts the second process.
- torchrun: a script that names the backend and never imports collectives (torch's
  ``torch.backends`` entry point registers the name).
- Hugging Face accelerate (``accelerate launch --multi_gpu --num_processes 2``, which starts
  the processes through torchrun; ``--cpu`` would start one): ``collectives.init_process_group("gloo")``
  before ``Accelerator(cpu=True)``, which joins that group.

A framework that is not installed skips, saying so; where the run must have them
(COLLECTIVES_TEST_REQUIRE names ``frameworks``: CI's frameworks step) it fails instead.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.ranks import free_port
from tests.support.requires import needs_gloo, skip_unless_required

pytestmark = [pytest.mark.frameworks, needs_gloo, pytest.mark.timeout(600)]

SCRIPTS = os.path.join(ROOT, "tests", "frameworks", "scripts")


def _need(module, dist):
    """Skip unless ``module`` imports (fail where the run must have the frameworks)."""
    top = module.split(".")[0]  # (find_spec of a submodule raises where its package is missing)
    if importlib.util.find_spec(top) is None or importlib.util.find_spec(module) is None:
        skip_unless_required("frameworks", f"{dist} is not installed "
                             f"(pip install -c constraints.txt -e '.[frameworks]')")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PL_DISABLE_FORK="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "COLLECTIVES_TORCH_BRIDGE",
                "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        env.pop(var, None)
    return env


def _weights(cmd, out, world=2, env=None):
    """Run ``cmd`` (which writes OUT.rank<r>) and read every rank's weights. (A run on
    torch's gloo leaves through tests/support/gloo_exit.py, past torch's abort at exit.)"""
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280,
                         env=env or _env())
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    got = []
    for r in range(world):
        with open(f"{out}.rank{r}") as f:
            got.append(f.read())
    return got


def _compare(ours, gloo):
    assert len(set(gloo)) == 1, "gloo's ranks disagree"
    for r, w in enumerate(ours):
        assert w == gloo[0], f"rank {r}: weights differ from torch gloo's run"


def _runs(tmp_path, cmd_for, env=None):
    """{backend: every rank's weights} for a gloo run and a collectives run."""
    got = {}
    for b in ("gloo", "collectives"):
        run_env = dict(env or _env())
        if "MASTER_ADDR" in run_env:  # a fresh port per run
            run_env["MASTER_PORT"] = str(free_port())
        got[b] = _weights(cmd_for(b, str(tmp_path / b)), str(tmp_path / b), env=run_env)
    return got


def test_lightning_ddp_strategy_by_backend_name(tmp_path):
    _need("lightning", "lightning")
    script = os.path.join(SCRIPTS, "lightning_train.py")

    def cmd(backend, out):
        return [sys.executable, script, backend, out]

    # Lightning starts the second process itself, on MASTER_ADDR/MASTER_PORT
    runs = _runs(tmp_path, cmd, env=dict(_env(), MASTER_ADDR="127.0.0.1"))
    _compare(runs["collectives"], runs["gloo"])


def test_torchrun_script_by_backend_name(tmp_path):
    _need("torch.distributed.run", "torch")
    script = os.path.join(SCRIPTS, "torchrun_train.py")

    def cmd(backend, out):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, backend, out]

    runs = _runs(tmp_path, cmd)
    _compare(runs["collectives"], runs["gloo"])


def test_accelerate_joins_collectives_group_made_first(tmp_path):
    _need("accelerate", "accelerate")
    script = os.path.join(SCRIPTS, "accelerate_train.py")

    def cmd(backend, out):
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port()), script, backend, out]

    runs = _runs(tmp_path, cmd)
    _compare(runs["collectives"], runs["gloo"])
