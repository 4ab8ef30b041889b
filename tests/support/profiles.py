"""Hypothesis profiles: ``ci`` (each test's own example count, as written), ``dev`` (a
tenth of it, but at least FLOOR, or the test's own count where that is lower: quick while
iterating) and ``thorough`` (ten times it, for a night run). Choose one with
``HYPOTHESIS_PROFILE=dev`` or ``pytest --hypothesis-profile=dev``.

Which profile a run gets when it names none (:func:`choose`, called from conftest.py):
``dev`` for the quick suite (a ``-m`` expression that contains ``not slow``), ``ci`` for
every other run, so ``pytest`` with no ``-m`` runs every property at full strength.

A test that sets its own count writes ``settings(max_examples=examples(8))``: the
profile scales it, so every profile keeps the tests' relative weights.
"""
import os

from hypothesis import settings

#: profile -> max_examples of tests that set none (100 is hypothesis' own default)
PROFILES = {"ci": 100, "dev": 10, "thorough": 1000}
#: the profile of a quick-suite run (-m "... not slow ...") that names none
QUICK_PROFILE = "dev"

for _name, _n in PROFILES.items():
    settings.register_profile(_name, max_examples=_n)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def choose(markexpr, named=None):
    """Load the run's profile: ``named`` (``--hypothesis-profile``) or HYPOTHESIS_PROFILE
    if given, else ``dev`` when ``markexpr`` deselects the slow tests, else ``ci``.
    Returns the profile's name."""
    name = named or os.environ.get("HYPOTHESIS_PROFILE")
    if not name:
        name = QUICK_PROFILE if "not slow" in " ".join((markexpr or "").split()) else "ci"
    settings.load_profile(name)
    return name


#: the fewest random examples a property draws under any profile (fewer only where its
#: own count is lower): a tenth of 8 is one, and one random example hardly varies
FLOOR = 4


def examples(n):
    """``n`` examples under the ``ci`` profile, scaled by the profile in force, and never
    fewer than ``min(n, FLOOR)``."""
    return max(min(n, FLOOR), n * settings.default.max_examples // PROFILES["ci"])
