"""What the framework scripts share: the model, each rank's data, the weights' bytes
written where the test reads them (``OUT.rank<r>``, hex), and the exit of a run on torch's
own gloo (tests/support/gloo_exit.py, found from the checkout's root, so a script runs by
hand without PYTHONPATH)."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after site-packages: an installed collectives still comes first
from tests.support.gloo_exit import end_if_torch_gloo  # noqa: E402,F401  (the scripts' import)

STEPS = 4
BATCH = 6


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def dataset(world):
    """STEPS batches per rank: rank r's samples are r, r + world, r + 2 * world... (what
    DistributedSampler without shuffling gives it)."""
    g = torch.Generator().manual_seed(7)
    n = STEPS * BATCH * world
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


def write_weights(out, rank, module):
    data = b"".join(p.detach().cpu().numpy().tobytes() for p in module.parameters())
    with open(f"{out}.rank{rank}", "w") as f:
        f.write(data.hex())
