"""What the framework scripts share: the model, each rank's data, and the weights' bytes
written where the test reads them (``OUT.rank<r>``, hex)."""
import torch

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
