"""Skip marks for tests that need an optional part: torch, or the gloo backend (which needs
the compiled _tcp extension, absent without a build or with COLLECTIVES_NO_EXTENSIONS=1)."""
import importlib.util

import pytest

from tests.support.ranks import config_available

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="needs torch (pip install 'collectives[torch]')")

_GLOO = config_available("gloo")
needs_gloo = pytest.mark.skipif(not _GLOO[0], reason=f"needs the gloo backend: {_GLOO[1]}")
