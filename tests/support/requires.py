"""Skip marks for tests that need an optional part: torch, the gloo backend (which needs
the compiled _tcp extension, absent without a build or with COLLECTIVES_NO_EXTENSIONS=1),
or the checkout's own files."""
import importlib.util

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
