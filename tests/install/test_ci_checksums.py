""".ci/checksums.py: the main job's checksums agree across ranks and with the reference."""
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.requires import needs_source_tree

pytestmark = needs_source_tree

SCRIPT = os.path.join(ROOT, ".ci", "checksums.py")


def job_output(values):
    return "".join(f"[{r}] rank {r} epoch 4 loss 0.1000\n[{r}] rank {r} done in 1.50 s, "
                   f"parameter checksum {v}\n" for r, v in enumerate(values))


def check(tmp_path, text):
    out = tmp_path / "job.txt"
    out.write_text(text)
    return subprocess.run([sys.executable, SCRIPT, str(out)], capture_output=True, text=True,
                          timeout=60)


def reference():
    with open(os.path.join(ROOT, ".ci", "train_sgd.checksum")) as f:
        return float(next(ln.split()[1] for ln in f if ln.startswith("checksum")))


def test_equal_checksums_at_the_reference_pass(tmp_path):
    p = check(tmp_path, job_output([f"{reference():.6f}"] * 4))
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("values,why", [
    (["{r}", "{r}", "{r2}", "{r}"], "differ"),       # one rank off, by a little
    (["{far}"] * 4, "is not the reference"),         # all agree, far from the reference
    (["{r}"] * 3, "expected 0..3"),                  # a rank's line missing
])
def test_a_rank_that_differs_a_far_result_or_a_missing_rank_fails(tmp_path, values, why):
    ref = reference()
    subst = {"r": f"{ref:.6f}", "r2": f"{ref + 1e-6:.6f}", "far": f"{ref + 1:.6f}"}
    p = check(tmp_path, job_output([v.format(**subst) for v in values]))
    assert p.returncode == 1 and why in p.stderr, p.stderr
