"""Where rank 0 is when no launcher said: Slurm's host lists and a port from the job.

``init_process_group()`` with ``env://`` needs MASTER_ADDR and MASTER_PORT. torchrun and
collectives-run set them; ``srun`` and ``mpiexec`` do not. :func:`derive_master` finds
them from what those launchers do set, as Lightning, Horovod and submitit do under Slurm:

* under Slurm (a task with ``SLURM_JOB_ID``, ``SLURM_PROCID`` and a node list, and no
  ``RANK`` of another launcher), the first host of
  ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), where task 0 runs under Slurm's
  default block distribution, and port ``15000 + the job id's last four digits``
  (Lightning's rule, so every task computes the same one);
* with every rank on one host (the launcher's local size equals its world size:
  mpiexec's ``MPI_LOCALNRANKS``, Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``), the
  loopback address and a port in [15000, 25000) from the job's identity (Open MPI's or
  PMIx's job id, else the launcher's process id, the parent every rank shares).

Example:
    >>> expand_hostlist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> derive_master({"SLURM_JOB_ID": "123456", "SLURM_PROCID": "0",
    ...                "SLURM_JOB_NODELIST": "node[07-08]"})
    ('node07', 18456, 'Slurm: first host of SLURM_JOB_NODELIST, port 15000 + job id % 10000')
"""
import itertools
import os
import re
import zlib

__all__ = ["expand_hostlist", "first_host", "slurm_port", "derive_master"]

PORT_BASE = 15000  # below Linux's ephemeral ports (32768-60999): no clash with a client socket
PORT_SPAN = 10000

_RANGE = re.compile(r"(\d+)(?:-(\d+))?$")


def _split_top(text):
    """Split at the commas outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            if depth:
                raise ValueError(f"host list {text!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"host list {text!r}: ']' without '['")
            depth = 0
        elif ch == "," and not depth:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if depth:
        raise ValueError(f"host list {text!r}: '[' without ']'")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(body, text):
    """``01-03,7`` -> ``01 02 03 7``: a range's numbers are as wide as its low bound
    (Slurm's zero padding)."""
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"host list {text!r}: {item!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            yield lo
            continue
        if int(hi) < int(lo):
            raise ValueError(f"host list {text!r}: range {item!r} runs backwards")
        width = len(lo)
        for n in range(int(lo), int(hi) + 1):
            yield str(n).zfill(width)


def _expand_one(pattern, text):
    """One host pattern: text and bracket groups, each group a list of numbers and ranges
    (several groups give their product, in order, the last varying fastest)."""
    pieces = re.split(r"\[([^\]]*)\]", pattern)  # text, group, text, group, ..., text
    choices = []
    for i, piece in enumerate(pieces):
        if i % 2:
            choices.append(list(_expand_ranges(piece, text)))
        else:
            choices.append([piece])
    for combo in itertools.product(*choices):
        yield "".join(combo)


def expand_hostlist(text):
    """Slurm's compressed host list (``node[01-04,07],login1``) as a list of host names.

    Args:
        text: a host list as in SLURM_JOB_NODELIST: comma-separated patterns, each a name
            with bracketed numbers and ranges (``a-b``, zero-padded as the low bound).

    Returns:
        The host names in order (an empty text gives ``[]``).

    Raises:
        ValueError: unbalanced brackets, a range that runs backwards, or text inside
            brackets that is not numbers and ranges.
    """
    out = []
    for pattern in _split_top(text):
        out.extend(_expand_one(pattern, text))
    return out


def first_host(text):
    """The first host of a Slurm host list, without expanding the rest; None if empty."""
    parts = _split_top(text)
    if not parts:
        return None
    return next(_expand_one(parts[0], text), None)


def slurm_port(job_id):
    """The port every task of Slurm job ``job_id`` derives: 15000 + its last four digits
    (Lightning's rule)."""
    digits = re.sub(r"\D", "", str(job_id))
    if not digits:
        raise ValueError(f"SLURM_JOB_ID must be a job number, got {job_id!r}")
    return PORT_BASE + int(digits[-4:]) % PORT_SPAN


def _job_key(environ):
    for var in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME"):
        if environ.get(var):
            return f"{var}={environ[var]}"
    # MPICH's hydra sets no job id: its proxy, the parent of every rank on a host, names it
    return f"ppid={os.getppid()}"


# (world-size variable, local-size variable, launcher) of the launchers that set no MASTER_*
_ONE_HOST = (
    ("PMI_SIZE", "MPI_LOCALNRANKS", "mpiexec (MPICH)"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpiexec (Open MPI)"),
)


def derive_master(environ=None):
    """``(addr, port, how)`` of rank 0's store where MASTER_ADDR is unset, else None.

    Slurm first (``SLURM_JOB_ID`` and ``SLURM_PROCID`` with ``SLURM_STEP_NODELIST`` or
    ``SLURM_JOB_NODELIST``, and no ``RANK``),
    then an mpiexec whose ranks are all on this host (local size = world size). ``how``
    says which rule gave them, for messages. None where neither applies: the caller says
    what to set.
    """
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID", "").strip()
    # a Slurm task (srun's, or a batch script's), not torchrun's workers inside an allocation
    if job and environ.get("SLURM_PROCID", "").strip() and not environ.get("RANK", "").strip():
        for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
            hosts = environ.get(var, "").strip()
            if hosts:
                host = first_host(hosts)
                if host:
                    return (host, slurm_port(job),
                            f"Slurm: first host of {var}, port 15000 + job id % 10000")
    for world_var, local_var, who in _ONE_HOST:
        world, local = environ.get(world_var, "").strip(), environ.get(local_var, "").strip()
        if world and local and world == local:
            key = _job_key(environ)
            port = PORT_BASE + zlib.crc32(key.encode()) % PORT_SPAN
            return ("127.0.0.1", port,
                    f"{who}: all {world} ranks on this host ({local_var}={local}), loopback, "
                    f"port from the job ({key})")
    return None
