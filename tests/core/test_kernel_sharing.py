"""The transports run collectives.engines._core's reduction kernels, not copies of their own.

The kernels are compiled once, into ``_core``; ``_tcp`` and ``_shm`` call them through the
table ``_core`` exports (the capsule ``collectives.engines._core._C_API``). So forcing an instruction
set in ``_core`` (as tests/core/test_kernels.py does) switches what the TCP algorithms and the
shared-memory collectives run, and their results on every forced set equal NumPy's.
"""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import collectives  # noqa: F401  (first: COLLECTIVES_NO_EXTENSIONS hides the extensions on import)
from tests.support.ranks import ROOT, backend_pool, config_available

core = pytest.importorskip("collectives.engines._core", reason="build it: setup.py build_ext --inplace")

ISAS = ["avx512bf16", "avx512", "avx2", "baseline"]
TRANSPORTS = ["_tcp", "_shm"]


def _transport(name):
    if importlib.util.find_spec(f"collectives.engines.{name}") is None:
        pytest.skip(f"collectives.engines.{name} is not built (or hidden)")
    return importlib.import_module(f"collectives.engines.{name}")


@pytest.mark.parametrize("name", TRANSPORTS)
def test_forcing_an_instruction_set_in_core_switches_the_transports_kernels(name):
    mod = _transport(name)
    best = core.kernel_isa()
    assert mod.kernel_isa() == best
    forced = []
    try:
        for isa in ISAS:
            if core._force_isa(isa):
                forced.append(isa)
                assert mod.kernel_isa() == isa, f"{name} still runs {mod.kernel_isa()} after {isa}"
    finally:
        assert core._force_isa(best)
    assert "baseline" in forced
    assert mod.kernel_isa() == best


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_transport_without_core_fails_to_import_naming_it(name):
    if importlib.util.find_spec(f"collectives.engines.{name}") is None:
        pytest.skip(f"collectives.engines.{name} is not built (or hidden)")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["collectives.engines._core"] = None  # as if it were not built
        try:
            import collectives.engines.{name}
        except ImportError as exc:
            print("ImportError:", exc)
        else:
            print("imported")
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("COLLECTIVES_NO_EXTENSIONS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError:"), out.stdout
    assert "collectives.engines._core" in out.stdout and "build_ext" in out.stdout, out.stdout


# ---- all_reduce on every instruction set, through the transports ---------------------------

# element counts: below and above the small-message thresholds (shm one-shot and TCP recursive
# doubling, 64 KiB by default), so both the small and the segmented paths reduce
COUNTS = (1, 17, 1000, 70001)
FAMILY_OPS = {
    "float": ("SUM", "PRODUCT", "MIN", "MAX"),
    "complex": ("SUM", "PRODUCT"),
    "int": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
}
NUMPY_DTYPES = {"float16": "float", "float32": "float", "float64": "float",
                "complex64": "complex", "complex128": "complex", "int8": "int", "uint8": "int",
                "int16": "int", "int32": "int", "int64": "int", "bool": "int"}


def _inputs(seed, rank, dtype, count):
    """Rank ``rank``'s input: values with full mantissas (rounding matters), small ints, bools."""
    import numpy as np
    rng = np.random.default_rng([seed, rank, count, sum(map(ord, dtype))])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    if dtype.startswith("complex"):
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
    return (rng.standard_normal(count) * 3).astype("float32" if dtype == "bfloat16" else dtype)


def all_reduce_on_each_isa(ctx, seed, transports):
    """On every rank: for each instruction set this CPU has, all_reduce every dtype/op/count
    and compare with NumPy (collectives.core.kernels_numpy) bit for bit. Returns (isas, mismatches)."""
    import importlib

    import numpy as np

    import collectives as dist
    from collectives.engines import _core
    from collectives.core import kernels_numpy as fb
    from collectives.core import dtypes as D

    torch = None
    if importlib.util.find_spec("torch") is not None:
        import torch
    cases = [(dt, fam) for dt, fam in NUMPY_DTYPES.items()]
    if torch is not None:
        cases.append(("bfloat16", "float"))
    mods = [importlib.import_module(f"collectives.engines.{t}") for t in transports]
    best = _core.kernel_isa()
    done, bad = [], []
    try:
        for isa in ISAS:
            if not _core._force_isa(isa):
                continue
            done.append(isa)
            seen = {m.__name__: m.kernel_isa() for m in mods}
            if set(seen.values()) != {isa}:
                bad.append(f"forced {isa}, the transports run {seen}")
            for dtype, fam in cases:
                for count in COUNTS:
                    xs = [_inputs(seed, r, dtype, count) for r in range(ctx.world_size)]
                    if dtype == "bfloat16":
                        xs = [torch.from_numpy(x).to(torch.bfloat16) for x in xs]
                    for op in FAMILY_OPS[fam]:
                        code = getattr(D, op)
                        got = xs[ctx.rank].clone() if dtype == "bfloat16" else xs[ctx.rank].copy()
                        dist.all_reduce(got, op=getattr(dist.ReduceOp, op))
                        want = xs[0].clone() if dtype == "bfloat16" else xs[0].copy()
                        fb.reduce_many(want, xs, code)
                        if dtype == "bfloat16":
                            got, want = got.view(torch.int16).numpy(), want.view(torch.int16).numpy()
                        if got.tobytes() != want.tobytes():
                            where = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
                            bad.append(f"{isa} {dtype} {op} count={count}: bytes differ from "
                                       f"NumPy's at {where[:5].tolist()}")
    finally:
        _core._force_isa(best)
    return done, bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config, transports", [("gloo", ["_shm", "_tcp"]), ("gloo-tcp", ["_tcp"])],
                         ids=["shm", "tcp"])
def test_all_reduce_on_every_instruction_set_equals_numpy(config, transports):
    ok, reason = config_available(config)
    if not ok:
        pytest.skip(reason)
    results = backend_pool(config, 2).run(all_reduce_on_each_isa, 5, transports, timeout=500)
    for rank, (isas, bad) in enumerate(results):
        assert "baseline" in isas
        assert not bad, f"rank {rank}: " + "; ".join(bad[:10])
