"""The test suite's shared helpers: rank pools (ranks), skip marks (requires), parameter
marks (marks), hypothesis profiles (profiles), the collective cases and their NumPy
reference (collective_cases), the third-party test backend (store_backend), the exit of a
run on torch's own gloo (gloo_exit), and the programs that tests start in subprocesses
(scripts/)."""
import os

# the checkout (or, in .ci/run's installed leg, the directory the tests were copied to)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def installed_checkout():
    """The checkout that .ci/run's installed leg built the wheel from
    (COLLECTIVES_TEST_INSTALLED), or None in an ordinary run."""
    return os.environ.get("COLLECTIVES_TEST_INSTALLED") or None
