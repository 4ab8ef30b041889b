"""Jobs started by srun and mpiexec find rank 0 without MASTER_ADDR: Slurm's host lists,
the derived address and port, and real jobs (mpiexec on one host; a one-node Slurm
cluster this module starts itself where root and Debian's slurm packages are there)."""
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives.launcher.hostlist import (derive_master, expand_hostlist, first_host,
                                           slurm_port)
from collectives.store.rendezvous import meet
from tests.support.ranks import ROOT, free_port, mpiexec_path
from tests.support.requires import needs_gloo, skip_unless_required

PROGRAM = os.path.join(ROOT, "examples", "numpy_allreduce.py")
EXPECTED = "all_reduce 10, broadcast [0, 1, 2], all_gather [0, 10, 20, 30]"


# ---- Slurm's compressed host lists ---------------------------------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("login1", ["login1"]),
    ("vm", ["vm"]),
    ("gpu[9-10]", ["gpu9", "gpu10"]),
    ("c[1-2]-ib,d[5]", ["c1-ib", "c2-ib", "d5"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("", []),
])
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts
    assert first_host(text) == (hosts[0] if hosts else None)


@pytest.mark.parametrize("text", ["a[1-2", "a1-2]", "a[3-1]", "a[x]", "a[[1]]", "a[1-]"])
def test_a_malformed_host_list_raises_naming_it(text):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(text)


def _compress(hosts):
    """The reference writer: consecutive numbers of one prefix and width become a range."""
    out = []
    for prefix, nums, width in hosts:
        nums = sorted(set(nums))
        runs, start = [], nums[0]
        for a, b in zip(nums, nums[1:] + [None]):
            if b != a + 1:
                lo, hi = str(start).zfill(width), str(a).zfill(width)
                runs.append(lo if start == a else f"{lo}-{hi}")
                start = b
        out.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(out)


_groups = st.lists(st.tuples(st.from_regex(r"[a-z][a-z-]{0,6}[a-z]", fullmatch=True),
                             st.lists(st.integers(0, 300), min_size=1, max_size=12),
                             st.integers(1, 4)),
                   min_size=1, max_size=4)


@given(_groups)
def test_expanding_a_compressed_list_gives_every_host_in_order(groups):
    # a number wider than the padding keeps its digits, as Slurm prints it
    groups = [(p, sorted(set(n)), w) for p, n, w in groups]
    text = _compress(groups)
    want = [f"{p}{str(k).zfill(w)}" for p, nums, w in groups for k in nums]
    assert expand_hostlist(text) == want
    assert first_host(text) == want[0]


# ---- the derived address and port ------------------------------------------------------------

SLURM = {"SLURM_JOB_ID": "4321987", "SLURM_PROCID": "2", "SLURM_NTASKS": "8",
         "SLURM_JOB_NODELIST": "node[07-08],login1", "SLURM_STEP_NODELIST": "node[08]"}


def test_under_slurm_rank_0_is_the_first_host_of_the_step_and_the_port_the_jobs():
    addr, port, how = derive_master(SLURM)
    assert (addr, port) == ("node08", 15000 + 1987)
    assert "SLURM_STEP_NODELIST" in how
    job_only = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert derive_master(job_only)[:2] == ("node07", slurm_port("4321987"))


@given(st.integers(1, 10**9))
def test_every_task_of_a_job_derives_one_port_outside_the_ephemeral_range(job):
    port = slurm_port(str(job))
    assert 15000 <= port < 25000
    assert port == slurm_port(str(job))


def test_torchrun_inside_an_allocation_is_not_taken_for_slurms_tasks():
    assert derive_master(dict(SLURM, RANK="0")) is None


@pytest.mark.parametrize("env,want", [
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"}, "127.0.0.1"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "77"}, "127.0.0.1"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}, None),  # two hosts
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, None),
])
def test_mpiexec_on_one_host_meets_on_the_loopback(env, want):
    got = derive_master(env)
    assert (got and got[0]) == want
    if got:
        assert 15000 <= got[1] < 25000 and got[1] == derive_master(env)[1]


@pytest.mark.timeout(30)
def test_ranks_on_several_hosts_without_master_addr_are_told_what_to_set():
    env = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match="MASTER_ADDR.*Slurm.*one host.*Set MASTER_ADDR"):
        meet("env://", environ=env, timeout=1)


@pytest.mark.timeout(30)
def test_a_derived_address_is_used_by_the_env_rendezvous():
    port = free_port()
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "MASTER_PORT": str(port)}
    store, rank, world = meet("env://", environ=env, timeout=5)
    try:
        assert (rank, world) == (0, 1)
        assert store.port == port
    finally:
        store.close()


def _job_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MASTER_", "SLURM_", "PMI_", "OMPI_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **extra)
    return env


def _four_ranks_agree(out):
    # the ranks share one pipe: a line may run into another's
    ranks = sorted(re.findall(r"rank (\d+): " + re.escape(EXPECTED), out))
    assert ranks == ["0", "1", "2", "3"], out


@needs_gloo
@pytest.mark.timeout(180)
@pytest.mark.skipif(mpiexec_path() is None, reason="needs mpiexec (pip install 'collectives[mpi]')")
def test_mpiexec_on_one_host_runs_the_default_backend_without_master_addr():
    p = subprocess.run([mpiexec_path(), "-n", "4", sys.executable, PROGRAM], env=_job_env(),
                       cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    _four_ranks_agree(p.stdout)


# ---- a real one-node Slurm cluster ---------------------------------------------------------

SBIN = os.pathsep.join(["/usr/sbin", "/usr/bin", "/sbin", "/bin"])


def _slurm_missing():
    if os.geteuid() != 0:
        return "starting slurmctld, slurmd and munged needs root"
    missing = [t for t in ("slurmctld", "slurmd", "srun", "sinfo", "munged")
               if shutil.which(t, path=SBIN) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install slurmd slurmctld "
                f"slurm-client munge)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (apt-get install munge)"
    return None


def _wait_for(check, seconds, what, logs):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    text = "".join(f"\n--- {p}\n{open(p).read()[-2000:]}" for p in logs if os.path.exists(p))
    raise RuntimeError(f"{what} within {seconds} s{text}")


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm cluster of this host, in a private directory with its own munged and
    ports: ``SLURM_CONF``'s value. 4 CPUs declared (SlurmdParameters=config_overrides) so that
    4 tasks fit on a 2-core machine."""
    reason = _slurm_missing()
    if reason:
        skip_unless_required("slurm", reason)
    d = tempfile.mkdtemp(prefix="collectives-slurm-")
    os.chmod(d, 0o755)  # munged (its own user) reaches its socket through it
    mkey, mrun = os.path.join(d, "munge"), os.path.join(d, "munge-run")
    munge = pwd.getpwnam("munge")
    for sub, mode in ((mkey, 0o700), (mrun, 0o755)):
        os.mkdir(sub, mode)
        os.chown(sub, munge.pw_uid, munge.pw_gid)
    key = os.path.join(mkey, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    os.chown(key, munge.pw_uid, munge.pw_gid)
    for sub in ("state", "spool"):
        os.mkdir(os.path.join(d, sub))
    sock = os.path.join(mrun, "munge.socket")
    host = os.uname().nodename.split(".")[0]
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(f"""ClusterName=collectives-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
NodeName={host} CPUs=4 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = dict(os.environ, SLURM_CONF=conf, PATH=SBIN + os.pathsep + os.environ.get("PATH", ""))
    logs = [os.path.join(mkey, "munged.log"), os.path.join(d, "slurmctld.log"),
            os.path.join(d, "slurmd.log")]
    procs = []
    munged = None
    try:
        subprocess.run(["runuser", "-u", "munge", "--", shutil.which("munged", path=SBIN),
                        f"--socket={sock}", f"--key-file={key}",
                        f"--pid-file={mrun}/munged.pid", f"--log-file={mkey}/munged.log",
                        f"--seed-file={mkey}/seed"], check=True, timeout=30)
        _wait_for(lambda: os.path.exists(f"{mrun}/munged.pid"), 10, "munged did not start", logs)
        munged = int(open(f"{mrun}/munged.pid").read())
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([shutil.which(daemon, path=SBIN), "-D", "-f", conf],
                                          env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))

        def idle():
            p = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                               text=True, timeout=10)
            return p.returncode == 0 and p.stdout.strip() == "idle"
        _wait_for(idle, 60, "the node did not come up idle", logs)
        yield env
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if munged:
            try:
                os.kill(munged, 15)
            except ProcessLookupError:
                pass
        shutil.rmtree(d, ignore_errors=True)


def _srun(slurm, *args, **extra):
    env = _job_env(**extra)
    env.update(SLURM_CONF=slurm["SLURM_CONF"], PATH=slurm["PATH"])
    return subprocess.run(["srun", "-n", "4", "--kill-on-bad-exit=1", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=150)


@pytest.mark.slurm
@needs_gloo
@pytest.mark.timeout(240)
def test_srun_runs_the_default_backend_without_master_addr(slurm):
    p = _srun(slurm, sys.executable, PROGRAM)
    assert p.returncode == 0, p.stdout + p.stderr
    _four_ranks_agree(p.stdout)


@pytest.mark.slurm
@needs_gloo
@pytest.mark.timeout(240)
def test_srun_with_master_addr_and_port_given_uses_them(slurm):
    port = free_port()
    # every rank reads the key rank 0 set at the rendezvous from a store client of its own
    # at MASTER_ADDR:MASTER_PORT: the group met there
    code = ("import os, collectives as dist; dist.init_process_group('gloo'); "
            "s = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), "
            "is_master=False, timeout=__import__('datetime').timedelta(seconds=20)); "
            "s.get('collectives/rendezvous/server'); "
            "print('port', os.environ['MASTER_PORT'], dist.get_rank(), dist.get_world_size()); "
            "dist.barrier(); dist.destroy_process_group()")
    p = _srun(slurm, sys.executable, "-c", code, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert p.returncode == 0, p.stdout + p.stderr
    ranks = sorted(line.split()[2] for line in p.stdout.splitlines() if line.startswith("port"))
    assert ranks == ["0", "1", "2", "3"], p.stdout
    assert all(line.split()[1] == str(port) and line.split()[3] == "4"
               for line in p.stdout.splitlines() if line.startswith("port")), p.stdout
