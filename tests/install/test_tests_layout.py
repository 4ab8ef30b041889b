"""The test suite's own layout (docs/testing.md, "Where a test goes"): test modules live in
the area folders, never at the top of tests/, and every folder that holds test modules is
a package, so that two areas may hold modules of the same name."""
import os

from tests.support import ROOT

TESTS = os.path.join(ROOT, "tests")


def test_no_test_module_at_the_top_of_tests():
    top = sorted(f for f in os.listdir(TESTS) if f.endswith(".py"))
    assert top == ["__init__.py", "conftest.py"], (
        f"tests/ holds {top}: a test module goes in the folder of the layer it tests, a "
        f"helper in tests/support/ (docs/testing.md)")


def test_every_folder_of_test_modules_is_a_package():
    missing = []
    for dp, dns, fs in os.walk(TESTS):
        dns[:] = [d for d in dns if d != "__pycache__"]
        if any(f.startswith("test_") and f.endswith(".py") for f in fs) and "__init__.py" not in fs:
            missing.append(os.path.relpath(dp, ROOT))
    assert not missing, f"add an __init__.py to {missing}"
