"""Compare the main job's parameter checksums: every rank's is the same, and each is the
stored reference's (.ci/train_sgd.checksum) within its tolerance.

    python .ci/checksums.py JOB_OUTPUT [REFERENCE]

JOB_OUTPUT is what ``collectives-run -n 4 examples/train_sgd.py`` printed (every rank ends
with "rank R done in S s, parameter checksum C"). The ranks average gradients with
all_reduce, so they hold equal parameters, bit for bit; the reference allows for sums taken
in another order (the shared-memory all_reduce picks its algorithm by timing its own calls).
"""
import os
import re
import sys

LINE = re.compile(r"rank (\d+) done in [\d.]+ s, parameter checksum (-?[\d.]+(?:e-?\d+)?)")


def read_reference(path):
    """{"world": int, "checksum": float, "tolerance": float} from ``key value`` lines."""
    ref = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                key, value = line.split()
                ref[key] = int(value) if key == "world" else float(value)
    return ref


def check(text, ref):
    """The problems found (empty: the checksums agree)."""
    got = {}
    for rank, value in LINE.findall(text):
        got[int(rank)] = value
    problems = []
    if sorted(got) != list(range(ref["world"])):
        problems.append(f"checksums from ranks {sorted(got)}, expected 0..{ref['world'] - 1}")
    if len(set(got.values())) > 1:
        problems.append(f"the ranks' checksums differ: {got}")
    for rank, value in sorted(got.items()):
        if abs(float(value) - ref["checksum"]) > ref["tolerance"]:
            problems.append(f"rank {rank}'s checksum {value} is not the reference "
                            f"{ref['checksum']} within {ref['tolerance']}")
    return problems


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    ref = read_reference(argv[2] if len(argv) > 2 else os.path.join(here, "train_sgd.checksum"))
    with open(argv[1]) as f:
        problems = check(f.read(), ref)
    for p in problems:
        print("checksums:", p, file=sys.stderr)
    if not problems:
        print(f"checksums: {ref['world']} ranks agree, and match the reference {ref['checksum']}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
