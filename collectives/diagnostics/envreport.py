"""``python -m collectives`` / ``collectives-info``: the environment report for bug reports.

What torch's ``python -m torch.utils.collect_env`` and ``python -m mpi4py
--mpi-lib-version`` print, for what this package's behaviour depends on:

* versions: this package, Python, NumPy, torch (and whether the torch bridge is on),
  mpi4py and the MPI library's own version string;
* how this copy was built: which compiled extensions load, and the kernel instruction set
  the dispatch picked;
* what the host offers: NCCL (path, version) and CUDA devices; cores, sockets and the
  last-level cache as the shared-memory path sees them; whether ranks may read each other's
  memory (CMA, the single-copy paths) and the near/far verdict of the shared-memory
  latency probe, made here between two threads of this process;
* configuration: the launcher variables seen, where env:// would meet, and every
  ``COLLECTIVES_*`` setting that differs from its default, with the variable it came from.

``--json`` prints the same as one JSON object. Nothing here starts a group or changes a
setting; the MPI version is read in a child process so that this one's MPI stays
uninitialised.

Example:
    $ python -m collectives --json | python -m json.tool
"""
import ctypes
import ctypes.util
import glob
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import threading

from .. import config

__all__ = ["collect", "format_text", "main"]

# launchers' variables worth seeing in a report (prefixes end with "_")
LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "PMI_RANK", "PMI_SIZE",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_", "PMIX_RANK", "PMIX_NAMESPACE",
    "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NTASKS_PER_NODE", "GLOO_SOCKET_IFNAME",
    "TORCH_FR_", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_",
)
# another variable that comes first for a setting (torch's name)
FIRST = {"COLLECTIVES_FR_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
         "COLLECTIVES_FR_DUMP": "TORCH_FR_DUMP_TEMP_FILE"}
SECRET = ("COLLECTIVES_AUTH_KEY", "COLLECTIVES_POOL_KEY")


def _guard(fn, *args):
    """``fn(*args)``, or ``{"error": ...}`` where it raises: a report never fails."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (one part's failure is part of the report)
        return {"error": f"{type(e).__name__}: {e}"}


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- versions --------------------------------------------------------------------------------

def _versions(use_torch, environ):
    import numpy
    out = {
        # as collectives.__version__ and the package's folder, read from here (the package's
        # __init__ is a layer above this module)
        "collectives": {"version": _dist_version("collectives") or "0+unknown",
                        "path": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "executable": sys.executable, "platform": platform.platform()},
        "numpy": {"version": numpy.__version__},
        "torch": _guard(_torch, use_torch, environ),
        "mpi4py": _guard(_mpi),
    }
    return out


def _torch(use_torch, environ):
    installed = _dist_version("torch")
    bridge_setting = config.get("COLLECTIVES_TORCH_BRIDGE", environ)
    info = {"installed": installed, "imported": sys.modules.get("torch") is not None,
            "bridge_setting": bridge_setting}
    if installed is None and not info["imported"]:
        info["bridge"] = "off: torch is not installed (pip install 'collectives[torch]')"
        return info
    if use_torch and not info["imported"]:
        try:
            import torch  # noqa: F401
        except Exception as e:  # noqa: BLE001  (torch's import can fail in many ways)
            info["import_error"] = f"{type(e).__name__}: {e}"
    torch = sys.modules.get("torch")
    if torch is not None:
        info["imported"] = True
        info["version"] = torch.__version__
        info["cuda"] = getattr(torch.version, "cuda", None)
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["distributed_available"] = bool(torch.distributed.is_available())
    if not bridge_setting:
        info["bridge"] = "off: COLLECTIVES_TORCH_BRIDGE is false"
    elif info.get("imported"):
        info["bridge"] = ("active: torch is imported, so init_process_group makes groups that "
                          "are torch ProcessGroups too")
    else:
        info["bridge"] = ("inactive here (torch not imported); active in a program that "
                          "imports torch before init_process_group")
    return info


_MPI_CHILD = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False; "
              "from mpi4py import MPI; print(MPI.Get_library_version().strip())")


def _mpi():
    version = _dist_version("mpi4py")
    if version is None:
        return {"installed": None, "note": "no mpi4py: pip install 'collectives[mpi]'"}
    info = {"installed": version}
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None:  # already loaded here: asking costs nothing and initialises nothing
        info["library"] = mod.Get_library_version().strip()
        return info
    # in a child, so this process's MPI is not loaded (a later MPI_Init here stays possible)
    p = subprocess.run([sys.executable, "-c", _MPI_CHILD], capture_output=True, text=True,
                       timeout=60, env=_child_env())
    if p.returncode == 0:
        info["library"] = p.stdout.strip()
    else:
        info["library_error"] = (p.stderr.strip().splitlines() or ["failed"])[-1]
    return info


def _child_env():
    # not one of a launcher's ranks: an MPI library must not try to join the job's PMI
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDI_", "MPI_LOCAL"))}


# ---- the build -------------------------------------------------------------------------------

def _build():
    exts = {}
    for name in config.EXTENSIONS:
        full = f"collectives.engines.{name}"
        if full in sys.modules and sys.modules[full] is None:
            exts[name] = "hidden (COLLECTIVES_NO_EXTENSIONS)"
            continue
        try:
            mod = importlib.import_module(full)
            exts[name] = os.path.basename(mod.__file__)
        except ImportError as e:
            exts[name] = f"missing ({e})"
    out = {"extensions": exts}
    try:
        from ..engines import _core
        out["kernel_isa"] = _core.kernel_isa()
    except ImportError:
        out["kernel_isa"] = "none: the NumPy fallback runs the reduction kernels"
    return out


# ---- the host -------------------------------------------------------------------------------

def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpus():
    online = os.cpu_count()
    allowed = sorted(os.sched_getaffinity(0))
    packages, cores = set(), set()
    for cpu in allowed:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        pkg, core = _read(f"{base}/physical_package_id"), _read(f"{base}/core_id")
        if pkg is not None:
            packages.add(pkg)
            cores.add((pkg, core))
    llc, level = None, -1
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        lvl, size, kind = _read(f"{index}/level"), _read(f"{index}/size"), _read(f"{index}/type")
        if lvl and size and kind in ("Unified", "Data") and int(lvl) > level:
            level, llc = int(lvl), size
    return {"online": online, "allowed": len(allowed), "sockets": len(packages) or None,
            "cores": len(cores) or None, "llc": f"L{level} {llc}" if llc else None,
            "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled")}


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cma():
    """Whether process_vm_readv works here (not blocked by a seccomp filter) and whether
    Yama lets a rank read a sibling rank's memory (ptrace_scope 0, or root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    src, dst = ctypes.c_uint64(0x636D61), ctypes.c_uint64(0)
    local = _Iovec(ctypes.cast(ctypes.byref(dst), ctypes.c_void_p), 8)
    remote = _Iovec(ctypes.cast(ctypes.byref(src), ctypes.c_void_p), 8)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    n = fn(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    syscall = n == 8 and dst.value == src.value
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    scope = int(scope) if scope is not None else None
    siblings = syscall and (scope in (None, 0) or (scope == 1 and os.geteuid() == 0))
    out = {"process_vm_readv": syscall, "ptrace_scope": scope, "between_ranks": siblings}
    if not syscall:
        out["errno"] = os.strerror(ctypes.get_errno())
    return out


def _probe():
    """The shared-memory latency probe between two threads of this process, each on its own
    core: the verdict a group's ranks on those two cores would reach."""
    from ..engines import _shm
    from ..core.tensors import to_buffer
    import numpy as np
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"verdict": None, "why": "one core: no pair of cores to measure"}
    name = f"/collectives-report-{os.getpid()}-{os.urandom(4).hex()}"
    comms, result, errors = [None, None], {}, []
    start = threading.Barrier(2)

    def rank(r):
        try:
            os.sched_setaffinity(0, {cpus[r]})  # this thread only
            c = _shm.ShmComm(name, r == 0, r, 2, 1 << 20, 64 * 1024, 10.0, "report probe")
            comms[r] = c
            start.wait(10)
            c.barrier()
            if r == 0:
                _shm.unlink(name)
            c.set_thresholds(64 * 1024, 512 * 1024)
            c.set_stream(2)  # measured: the probes decide
            buf = to_buffer(np.ones(128 * 1024))  # 1 MiB steps: every 16th one probes
            for _ in range(400):
                c.all_reduce(buf, 0)
            result[r] = c.peer_distance(1 - r)
            c.barrier()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
            start.abort()
        finally:
            if comms[r] is not None:
                comms[r].close()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    _shm.unlink(name)
    if errors:
        return {"verdict": None, "why": "; ".join(errors)}
    words = {0: None, 1: "near", 2: "far"}
    verdicts = {words.get(result.get(0)), words.get(result.get(1))} - {None}
    cores = f"cpus {cpus[0]} and {cpus[1]}"
    if not verdicts:
        return {"verdict": None, "cores": cores,
                "why": "no probe gave a verdict (a partner was descheduled: a busy machine)"}
    return {"verdict": "far" if "far" in verdicts else "near", "cores": cores,
            "far_ns": config.get("COLLECTIVES_SHM_FAR_NS"),
            "means": "shared-memory writes stream" if "far" in verdicts else
            "shared-memory writes are plain stores"}


def _shm_info(probe):
    from ..backends.shm import shm_available
    out = {"available": shm_available(), "cpus": _guard(_cpus), "cma": _guard(_cma)}
    if not out["available"]:
        out["probe"] = {"verdict": None, "why": "no _shm extension or no writable /dev/shm"}
    elif probe:
        out["probe"] = _guard(_probe)
    else:
        out["probe"] = {"verdict": None, "why": "not run (--no-probe)"}
    return out


def _loaded_path(fragment):
    for line in (_read("/proc/self/maps") or "").splitlines():
        if fragment in line and "/" in line:
            return line[line.index("/"):]
    return None


def _nccl():
    from ..backends import nccl
    errors = []
    for path in nccl._library_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        code = ctypes.c_int(0)
        out = {"found": True, "path": _loaded_path(os.path.basename(path)) or path}
        if hasattr(lib, "ncclGetVersion") and lib.ncclGetVersion(ctypes.byref(code)) == 0:
            v = code.value  # 2.9 and later: major * 10000 + minor * 100 + patch
            out["version"] = (f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 20900
                              else f"{v // 1000}.{v // 100 % 10}.{v % 100}")
        return out
    return {"found": False, "tried": errors}


def _cuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {"driver": None, "devices": [], "note": "no CUDA driver (libcuda.so.1)"}
    if lib.cuInit(0) != 0:
        return {"driver": "present", "devices": [], "note": "cuInit failed: no usable GPU"}
    ver, count = ctypes.c_int(0), ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(ver))
    lib.cuDeviceGetCount(ctypes.byref(count))
    devices = []
    for i in range(count.value):
        dev, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
        lib.cuDeviceGet(ctypes.byref(dev), i)
        lib.cuDeviceGetName(name, 256, dev)
        devices.append(name.value.decode(errors="replace"))
    v = ver.value
    return {"driver": f"{v // 1000}.{v % 1000 // 10}", "devices": devices}


# ---- configuration --------------------------------------------------------------------------

def _launcher(environ):
    seen = {k: environ[k] for k in sorted(environ)
            if any(k == v or (v.endswith("_") and k.startswith(v)) for v in LAUNCHER_VARS)}
    from ..store.rendezvous import env_local_rank, env_rank_world
    out = {"variables": seen}
    rank, world = env_rank_world(environ)
    local_rank, local_world = env_local_rank(environ)
    out["rank"], out["world_size"] = rank, world
    out["local_rank"], out["local_world_size"] = local_rank, local_world
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        out["env_rendezvous"] = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']} (MASTER_ADDR/PORT)"
    else:
        from ..launcher.hostlist import derive_master
        derived = derive_master(environ)
        out["env_rendezvous"] = (f"{derived[0]}:{derived[1]} ({derived[2]})" if derived else
                                 "none: env:// needs MASTER_ADDR and MASTER_PORT here")
    return out


def _settings(environ):
    """Every setting whose value differs from its default, with the variable it came from;
    values that do not parse and ``COLLECTIVES_*`` names that are not settings."""
    changed, bad = {}, {}
    for s in config.SETTINGS:
        first = FIRST.get(s.name)
        source = first if first and environ.get(first, "").strip() else s.name
        try:
            value = config.get(s.name, environ, first=first)
        except ValueError as e:
            bad[s.name] = str(e)
            continue
        if value != s.default:
            shown = "(set; value hidden)" if s.name in SECRET else value
            changed[s.name] = {"value": shown, "default": s.default, "from": source,
                               "scope": s.scope}
    unknown = sorted(k for k in environ if k.startswith("COLLECTIVES_")
                     and k not in {s.name for s in config.SETTINGS})
    return {"changed": changed, "invalid": bad, "unknown": unknown}


# ---- the report ------------------------------------------------------------------------------

def collect(environ=None, use_torch=True, probe=True):
    """The report as a dict (what ``--json`` prints).

    Args:
        environ: the environment to describe (default ``os.environ``).
        use_torch: import torch, where installed, for its version and CUDA view (a few
            seconds); False reads only its installed version.
        probe: run the shared-memory latency probe between two threads (about 0.2 s).
    """
    environ = os.environ if environ is None else environ
    return {
        "versions": _guard(_versions, use_torch, environ),
        "build": _guard(_build),
        "host": {"shm": _guard(_shm_info, probe), "nccl": _guard(_nccl), "cuda": _guard(_cuda)},
        "launcher": _guard(_launcher, environ),
        "settings": _guard(_settings, environ),
    }


def _line(key, value):
    return f"  {key:<18} {value}"


def _describe(d, skip=()):
    if not isinstance(d, dict):
        return str(d)
    if "error" in d and len(d) == 1:
        return f"(could not tell: {d['error']})"
    return ", ".join(f"{k} {v}" for k, v in d.items() if k not in skip and v is not None)


def format_text(r):
    """The report as text, for a bug report."""
    out = []
    v = r["versions"]
    out.append("collectives environment report (python -m collectives)")
    out.append("Versions")
    if "error" in v:
        out.append(_line("(error)", v["error"]))
    else:
        c, py = v["collectives"], v["python"]
        out.append(_line("collectives", f"{c['version']} ({c['path']})"))
        out.append(_line("Python", f"{py['version']} {py['implementation']} ({py['executable']})"))
        out.append(_line("platform", py["platform"]))
        out.append(_line("NumPy", v["numpy"]["version"]))
        t = v["torch"]
        if "error" in t:
            out.append(_line("torch", _describe(t)))
        else:
            ver = t.get("version") or t.get("installed") or "not installed"
            extra = f", CUDA {t['cuda']}" if t.get("cuda") else ""
            out.append(_line("torch", f"{ver}{extra}"))
            if t.get("import_error"):
                out.append(_line("", f"import failed: {t['import_error']}"))
            out.append(_line("torch bridge", t["bridge"]))
        m = v["mpi4py"]
        out.append(_line("mpi4py", m.get("installed") or m.get("note") or _describe(m)))
        if m.get("library") or m.get("library_error"):
            lib = m.get("library") or f"(could not tell: {m['library_error']})"
            out.append(_line("MPI library", " ".join(lib.splitlines()[0].split())))
    b = r["build"]
    out.append("Build")
    if "error" in b:
        out.append(_line("(error)", b["error"]))
    else:
        for name, state in b["extensions"].items():
            out.append(_line(name, state))
        out.append(_line("kernel ISA", b["kernel_isa"]))
    h = r["host"]
    out.append("Host")
    shm = h["shm"]
    if "error" in shm:
        out.append(_line("shared memory", _describe(shm)))
    else:
        out.append(_line("shared memory", "available" if shm["available"] else "unavailable"))
        out.append(_line("CPUs", _describe(shm["cpus"])))
        cma = shm["cma"]
        if "between_ranks" in cma:
            verdict = "allowed" if cma["between_ranks"] else "not allowed"
            out.append(_line("CMA (single copy)", f"{verdict} between ranks (process_vm_readv "
                             f"{'works' if cma['process_vm_readv'] else 'blocked'}, ptrace_scope "
                             f"{cma['ptrace_scope']})"))
        else:
            out.append(_line("CMA (single copy)", _describe(cma)))
        p = shm["probe"]
        if p.get("verdict"):
            out.append(_line("near/far probe", f"{p['verdict']} ({p['cores']}): {p['means']}"))
        else:
            out.append(_line("near/far probe", f"no verdict: {p.get('why') or _describe(p)}"))
    n = h["nccl"]
    if n.get("found"):
        out.append(_line("NCCL", f"{n.get('version', 'version unknown')} ({n['path']})"))
    else:
        out.append(_line("NCCL", "not found" if "error" not in n else _describe(n)))
    cu = h["cuda"]
    if cu.get("devices"):
        out.append(_line("CUDA", f"driver {cu['driver']}: " + "; ".join(
            f"{i}: {d}" for i, d in enumerate(cu["devices"]))))
    else:
        out.append(_line("CUDA", cu.get("note") or _describe(cu)))
    la = r["launcher"]
    out.append("Launcher")
    if "error" in la:
        out.append(_line("(error)", la["error"]))
    else:
        if la["rank"] is None and la["world_size"] is None:
            out.append(_line("rank / world", "no launcher's variables"))
        else:
            out.append(_line("rank / world", f"{la['rank']} / {la['world_size']} (local "
                             f"{la['local_rank']} / {la['local_world_size']})"))
        out.append(_line("env:// meets at", la["env_rendezvous"]))
        for k, val in la["variables"].items():
            out.append(_line(k, val))
    s = r["settings"]
    out.append("Settings (COLLECTIVES_* that differ from their defaults)")
    if "error" in s:
        out.append(_line("(error)", s["error"]))
    else:
        if not (s["changed"] or s["invalid"] or s["unknown"]):
            out.append("  (none: every setting has its default)")
        for name, c in s["changed"].items():
            where = "" if c["from"] == name else f", from {c['from']}"
            out.append(f"  {name} = {c['value']!r} (default {c['default']!r}{where})")
        for name, err in s["invalid"].items():
            out.append(f"  {name}: invalid: {err}")
        for name in s["unknown"]:
            out.append(f"  {name}: not a setting (a typo?)")
    return "\n".join(out) + "\n"


def main(argv=None):
    """Entry point of ``python -m collectives`` and ``collectives-info``."""
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m collectives",
        description="Print the environment report to paste into a bug report.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-torch", action="store_true",
                   help="do not import torch (faster; its installed version is still shown)")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the shared-memory near/far probe")
    args = p.parse_args(argv)
    report = collect(use_torch=not args.no_torch, probe=not args.no_probe)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        sys.stdout.write(format_text(report))
    return 0
