"""Marks that test modules put on their own parameters.

A test whose every instance is slow, or that injects failures, says so with a decorator
(``@pytest.mark.slow``, ``@pytest.mark.faults``); a module of such tests with ``pytestmark``.
A parametrised test whose quick instances are a few of its parameter values names them
with :func:`quick_only`.
"""
import pytest


def quick_only(values, *quick, ids=None):
    """``values`` for ``pytest.mark.parametrize``, each one outside ``quick`` marked slow:
    the quick suite (``-m "not slow"``) runs the test on the ``quick`` values only.
    ``ids``: the values' test ids, as parametrize's ``ids`` takes them."""
    return [pytest.param(v, marks=() if v in quick else pytest.mark.slow,
                         id=None if ids is None else ids[i]) for i, v in enumerate(values)]
