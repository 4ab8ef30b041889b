"""``python -m collectives`` (``collectives-info``): the environment report, as text and as
JSON, without torch, with torch and under collectives-run."""
import json
import os
import subprocess
import sys

import pytest

import collectives
from collectives import config
from collectives.diagnostics.envreport import collect, format_text
from tests.support.ranks import ROOT
from tests.support.requires import HAVE_TORCH, needs_torch

# run in a child as a program would be; "torch" set to None in sys.modules makes its import
# fail, as where it is not installed
NO_TORCH = "import sys; sys.modules['torch'] = None; "
REPORT = "from collectives.diagnostics.envreport import main; sys.exit(main(sys.argv[1:]))"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVES_", "TORCH_FR_"))}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    return env


def _report(*args, prelude="import sys; ", **extra):
    p = subprocess.run([sys.executable, "-c", prelude + REPORT, *args], env=_env(**extra),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_a_report_names_the_versions_the_build_and_the_host():
    r = collect(use_torch=False, probe=False)
    v = r["versions"]
    assert v["collectives"]["version"] == collectives.__version__
    assert v["collectives"]["path"] == os.path.dirname(os.path.abspath(collectives.__file__))
    assert v["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    import numpy
    assert v["numpy"]["version"] == numpy.__version__
    assert set(r["build"]["extensions"]) == set(config.EXTENSIONS)
    assert r["host"]["shm"]["cpus"]["online"] == os.cpu_count()
    assert r["host"]["nccl"]["found"] in (True, False)
    text = format_text(r)
    for part in ("Versions", "Build", "Host", "Launcher", "Settings", "kernel ISA",
                 f"collectives        {collectives.__version__}"):
        assert part in text


@pytest.mark.timeout(120)
def test_without_torch_the_report_says_so_and_json_says_the_same():
    text = _report("--no-probe", prelude=NO_TORCH)
    data = json.loads(_report("--json", "--no-probe", prelude=NO_TORCH))
    t = data["versions"]["torch"]
    assert t["imported"] is False
    assert "version" not in t
    assert t["bridge"].startswith(("off", "inactive"))
    assert f"torch bridge       {t['bridge']}" in text
    assert data["versions"]["collectives"]["version"] in text


@pytest.mark.timeout(120)
def test_without_torch_dist_nn_is_an_attribute_error_naming_the_extra():
    code = (NO_TORCH + "import collectives as dist; assert not hasattr(dist, 'nn'); "
            "assert getattr(dist, 'nn', 7) == 7\ntry:\n    dist.nn\nexcept AttributeError as e:\n"
            "    print(e)")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=100)
    assert p.returncode == 0, p.stderr
    assert "collectives[torch]" in p.stdout


@needs_torch
@pytest.mark.timeout(120)
def test_with_torch_the_report_gives_its_version_and_the_bridge():
    import importlib.metadata
    data = json.loads(_report("--json", "--no-probe"))
    t = data["versions"]["torch"]
    assert t["imported"] is True
    assert t["version"].split("+")[0] == importlib.metadata.version("torch").split("+")[0]
    assert t["bridge"].startswith("active")
    off = json.loads(_report("--json", "--no-probe", COLLECTIVES_TORCH_BRIDGE="0"))
    assert off["versions"]["torch"]["bridge"].startswith("off")


def test_settings_that_differ_are_listed_with_their_source_and_secrets_are_hidden():
    typo = "COLLECTIVES_" + "TPC_SPIN_US"  # in two parts: tests/install/test_config.py finds whole names
    env = {"COLLECTIVES_TCP_SPIN_US": "7", "COLLECTIVES_SHM_ONESHOT_MAX": "65536",
           "TORCH_FR_BUFFER_SIZE": "3", "COLLECTIVES_AUTH_KEY": "s3cr3t-key",
           "COLLECTIVES_SHM_STREAM": "9", typo: "1"}
    s = collect(environ=env, use_torch=False, probe=False)["settings"]
    assert s["changed"]["COLLECTIVES_TCP_SPIN_US"] == {
        "value": 7, "default": 20, "from": "COLLECTIVES_TCP_SPIN_US", "scope": "runtime"}
    assert "COLLECTIVES_SHM_ONESHOT_MAX" not in s["changed"]  # set to its default
    assert s["changed"]["COLLECTIVES_FR_BUFFER_SIZE"]["from"] == "TORCH_FR_BUFFER_SIZE"
    assert "COLLECTIVES_SHM_STREAM" in s["invalid"]
    assert s["unknown"] == [typo]
    text = format_text(collect(environ=env, use_torch=False, probe=False))
    assert "s3cr3t-key" not in text and "COLLECTIVES_AUTH_KEY" in text
    assert f"{typo}: not a setting" in text


def test_the_launcher_section_says_where_env_rendezvous_would_meet():
    la = collect(environ={"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"},
                 use_torch=False, probe=False)["launcher"]
    assert (la["rank"], la["world_size"]) == (2, 4)
    assert la["env_rendezvous"].startswith("127.0.0.1:")
    assert la["variables"] == {"MPI_LOCALNRANKS": "4", "PMI_RANK": "2", "PMI_SIZE": "4"}


@pytest.mark.timeout(60)
def test_the_probe_gives_a_verdict_or_says_why_not():
    p = collect(use_torch=False)["host"]["shm"]["probe"]
    assert p["verdict"] in ("near", "far") or p["why"], p


@pytest.mark.timeout(200)
def test_under_collectives_run_every_rank_reports_its_own_rank():
    args = ["--no-probe"] + ([] if HAVE_TORCH else ["--no-torch"])
    p = subprocess.run([sys.executable, "-m", "collectives.run", "-n", "2", "-m", "collectives",
                        *args], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        assert f"[{r}]   rank / world       {r} / 2 (local {r} / 2)" in p.stdout, p.stdout
        assert f"[{r}]   env:// meets at    127.0.0.1:" in p.stdout
        # collectives-run gives the job a key: named, never shown
        assert f"[{r}]   COLLECTIVES_AUTH_KEY = '(set; value hidden)'" in p.stdout


@pytest.mark.timeout(120)
def test_the_console_script_and_python_m_print_the_same_report():
    script = os.path.join(os.path.dirname(sys.executable), "collectives-info")
    if not os.path.exists(script):
        pytest.skip("collectives-info is not installed next to this interpreter (pip install -e .)")
    a = subprocess.run([script, "--json", "--no-probe", "--no-torch"], env=_env(),
                       capture_output=True, text=True, timeout=100)
    b = subprocess.run([sys.executable, "-m", "collectives", "--json", "--no-probe",
                        "--no-torch"], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=100)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["versions"]["collectives"] == jb["versions"]["collectives"]
    assert ja["build"] == jb["build"]
