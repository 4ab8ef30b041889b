"""Skip marks for tests that need an optional part: torch, the gloo backend (which needs
the compiled _tcp extension, absent without a build or with COLLECTIVES_NO_EXTENSIONS=1),
or the checkout's own files; and the parts a run must have (COLLECTIVES_TEST_REQUIRE), whose
absence fails the tests that need them instead of skipping them."""
import importlib.util
import os

import pytest

from tests.support import installed_checkout
from tests.support.ranks import config_available

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="needs torch (pip install 'collectives[torch]')")

_GLOO = config_available("gloo")
needs_gloo = pytest.mark.skipif(not _GLOO[0], reason=f"needs the gloo backend: {_GLOO[1]}")

# Tests that read the checkout's own files (sources, docs): .ci/run's installed leg copies
# only tests/, examples/ and bench/ out of the tree, so they skip there, saying so.
needs_source_tree = pytest.mark.skipif(
    installed_checkout() is not None,
    reason="reads the checkout's sources or docs; the installed leg runs the tests outside it")


# ---- parts a run must have ---------------------------------------------------------------

#: the parts COLLECTIVES_TEST_REQUIRE may name (.ci/run lists the ones each leg must have)
PARTS = ("gloo", "shm", "hier", "mpi", "slurm", "netns")


def required():
    """The parts this run must have (COLLECTIVES_TEST_REQUIRE, comma-separated): a test
    that needs one of them fails where it is missing, instead of skipping."""
    names = [n.strip() for n in os.environ.get("COLLECTIVES_TEST_REQUIRE", "").split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise ValueError(f"COLLECTIVES_TEST_REQUIRE names {unknown}: the parts are {list(PARTS)}")
    return names


def skip_unless_required(part, reason):
    """Skip for ``reason``, or fail where this run must have ``part``."""
    if part in required():
        pytest.fail(f"this run must have {part} (COLLECTIVES_TEST_REQUIRE), but {reason}")
    pytest.skip(reason)
