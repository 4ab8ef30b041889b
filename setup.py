"""Build the Cython extensions.

Each extension (collectives/engines/<name>.pyx) compiles its C sources, which sit beside it
in collectives/engines/{kernels,tcp,shm}/. An extension whose .pyx is absent is skipped.
COLLECTIVES_ONLY=_tcp,_core builds just those (for work on one module);
COLLECTIVES_MARCH_NATIVE=1 adds -march=native (opt-in, not for wheels).
The extensions are built without debug information (-g0) and linked with their symbol
tables stripped (--strip-all; the exported symbols stay), as NumPy's wheels are;
COLLECTIVES_DEBUG_SYMBOLS=1 keeps both (for gdb or perf on a checkout).
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CFLAGS = ["-O3", "-fno-strict-aliasing", "-Wno-unused-function",
          # no FMA contraction: results must equal torch/NumPy bit for bit (complex products)
          "-ffp-contract=off"]
LDFLAGS = []
if os.environ.get("COLLECTIVES_MARCH_NATIVE") == "1":
    CFLAGS.append("-march=native")
if os.environ.get("COLLECTIVES_DEBUG_SYMBOLS") != "1":
    # after Python's own CFLAGS (which carry -g): the last -g option wins
    CFLAGS.append("-g0")
    LDFLAGS.append("-Wl,--strip-all")  # the symbol table too, as NumPy's wheels (exports stay)

# The reduction kernels are compiled once, into _core, which exports them as a C table in the
# capsule collectives.engines._core._C_API; _tcp and _shm call through it (reduce_kernels_import.c), so
# they need a built _core at import and share its instruction-set dispatch.
KERNEL_SOURCES = ["collectives/engines/kernels/reduce_kernels.c"]
KERNEL_IMPORT = ["collectives/engines/kernels/reduce_kernels_import.c"]
# module -> its C sources besides the .pyx
MODULES = {
    "_core": KERNEL_SOURCES,
    "_buffer": [],
    "_ncclcall": [],  # the nccl backend's calls into libnccl by address
    "_mpilog": [],  # the mpi backend's call log (collectives.backends.mpi.fingerprint)
    "_tcp": KERNEL_IMPORT + ["collectives/engines/tcp/tcp_transport.c",
                             "collectives/engines/tcp/tcp_engine.c",
                             "collectives/engines/tcp/tcp_algorithms.c"],
    "_shm": KERNEL_IMPORT + ["collectives/engines/shm/shm_segment.c",
                             "collectives/engines/shm/shm_copy.c",
                             "collectives/engines/shm/shm_coll.c", "collectives/engines/shm/shm_p2p.c",
                             "collectives/engines/shm/shm_tune.c",
                             "collectives/engines/shm/shm_mapped.c"],
}

only = [m for m in os.environ.get("COLLECTIVES_ONLY", "").split(",") if m]
extensions = []
for mod, extra in MODULES.items():
    pyx = os.path.join("collectives", "engines", mod + ".pyx")
    if not os.path.exists(os.path.join(HERE, pyx)) or (only and mod not in only):
        continue
    extensions.append(Extension(
        "collectives.engines." + mod,
        sources=[pyx] + extra,
        include_dirs=["collectives/engines", np.get_include()],
        extra_compile_args=CFLAGS,
        extra_link_args=LDFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ))

setup(ext_modules=cythonize(
    extensions,
    compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                         "cdivision": True, "initializedcheck": False},
))
