"""Build the Cython extensions.

Each extension links the C kernels in collectives/src. An extension whose .pyx
is absent is skipped. COLLECTIVES_ONLY=_tcp,_core builds just those (for work on
one module); COLLECTIVES_MARCH_NATIVE=1 adds -march=native (opt-in, not for wheels).
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CFLAGS = ["-O3", "-fno-strict-aliasing", "-Wno-unused-function",
          # no FMA contraction: results must equal torch/NumPy bit for bit (complex products)
          "-ffp-contract=off"]
if os.environ.get("COLLECTIVES_MARCH_NATIVE") == "1":
    CFLAGS.append("-march=native")

# module -> extra C sources (besides the kernels); _buffer needs no kernels
MODULES = {
    "_core": [],
    "_buffer": None,
    "_tcp": ["collectives/src/tcp_transport.c", "collectives/src/tcp_engine.c",
             "collectives/src/tcp_algorithms.c"],
    "_shm": ["collectives/src/shm_segment.c", "collectives/src/shm_copy.c",
             "collectives/src/shm_coll.c", "collectives/src/shm_p2p.c"],
}
KERNEL_SOURCES = ["collectives/src/reduce_kernels.c"]

only = [m for m in os.environ.get("COLLECTIVES_ONLY", "").split(",") if m]
extensions = []
for mod, extra in MODULES.items():
    pyx = os.path.join("collectives", mod + ".pyx")
    if not os.path.exists(os.path.join(HERE, pyx)) or (only and mod not in only):
        continue
    extensions.append(Extension(
        "collectives." + mod,
        sources=[pyx] if extra is None else [pyx] + KERNEL_SOURCES + extra,
        include_dirs=["collectives/src", np.get_include()],
        extra_compile_args=CFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ))

setup(ext_modules=cythonize(
    extensions,
    compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                         "cdivision": True, "initializedcheck": False},
))
