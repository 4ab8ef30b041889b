"""The figures README.md and docs/benchmarks.md state are what bench/results/ gives.

bench/claims.py computes each stated figure from its data file; these tests check each
document states it, beside the file's name and its launches per cell, and that the data
files are labelled as their names say.
"""
import importlib.util
import json
import os

import pytest

from tests.support import ROOT
from tests.support.requires import needs_source_tree

pytestmark = needs_source_tree


def load_claims():
    spec = importlib.util.spec_from_file_location("claims", os.path.join(ROOT, "bench", "claims.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def claims():
    return load_claims()


def test_every_stated_figure_is_what_its_data_gives(claims):
    assert claims.problems() == []


def test_each_claim_names_a_data_file_that_exists_and_its_launches(claims):
    for c in claims.claims():
        assert os.path.exists(os.path.join(claims.RESULTS, c.file)), c
        assert c.launches >= 1, c


def test_a_changed_figure_is_caught(claims, monkeypatch):
    """The check can fail: a claim whose data gave another figure is reported."""
    real = claims.claims

    def shifted():
        out = real()
        return [out[0]._replace(figure="0.99")] + out[1:]
    monkeypatch.setattr(claims, "claims", shifted)
    assert any("0.99" in p for p in claims.problems())


@pytest.mark.parametrize("when", ["before", "after"])
def test_the_16_core_files_rows_say_the_tree_their_name_says(when):
    path = os.path.join(ROOT, "bench", "results",
                        f"2026-11-27-s5-16core-{when}-shm-vs-mpich-openmpi.jsonl")
    with open(path) as f:
        trees = {json.loads(line)["tree"] for line in f if line.strip()}
    assert trees == {when}
