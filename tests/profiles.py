"""Hypothesis profiles: ``ci`` (the default: each test's own example count, as written),
``dev`` (a quarter of it, at least one: quick while iterating) and ``thorough`` (ten times
it, for a night run). Choose one with ``HYPOTHESIS_PROFILE=dev`` or
``pytest --hypothesis-profile=dev``.

A test that sets its own count writes ``settings(max_examples=examples(8))``: the
profile scales it, so every profile keeps the tests' relative weights.
"""
import os

from hypothesis import settings

#: profile -> max_examples of tests that set none (100 is hypothesis' own default)
PROFILES = {"ci": 100, "dev": 25, "thorough": 1000}

for _name, _n in PROFILES.items():
    settings.register_profile(_name, max_examples=_n)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(n):
    """``n`` examples under the ``ci`` profile, scaled by the profile in force."""
    return max(1, n * settings.default.max_examples // PROFILES["ci"])
