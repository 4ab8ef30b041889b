"""A torch.distributed program that names its backend: DDP trains a tiny model for a few
steps and rank 0 prints the weights' bytes (hex), for comparison with a run on torch's gloo.
Launched once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.

    python train_by_name.py BACKEND HOW

HOW is how the backend name comes to torch:

- ``import-after``: ``import collectives`` before torch;
- ``import-before``: ``import collectives`` after torch;
- ``none``: no import of collectives at all (the gloo reference, and torch's
  ``torch.backends`` entry point, which registers "collectives" at ``import torch``).

Each rank prints one line of facts (whether torch imported collectives, whether the bridge
was imported before the group was made) that the test checks.
"""
import sys

from tests.support.gloo_exit import end_if_torch_gloo

backend, how = sys.argv[1], sys.argv[2]
facts = {}
if how == "import-after":
    import collectives  # noqa: F401
    facts["torch_imported_by_collectives"] = "torch" in sys.modules
import torch  # noqa: E402
import torch.distributed as td  # noqa: E402

if how == "import-before":
    import collectives  # noqa: F401,E402
if how == "none":
    facts["collectives_imported_by_torch"] = "collectives" in sys.modules
facts["bridge_before_init"] = "collectives.torch_bridge.torch_pg" in sys.modules
td.init_process_group(backend)
facts["backend"] = td.get_backend()
rank = td.get_rank()
# torch's subgroups and device meshes over that default group: collectives' groups where
# the backend is collectives (torch's own elsewhere)
sub = td.new_group([0, 1])
facts["new_group"] = type(sub).__module__.split(".")[0]
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
facts["mesh_group"] = type(mesh.get_group("tp")).__module__.split(".")[0]
t = torch.ones(2)
td.all_reduce(t, group=mesh.get_group("tp"))
facts["mesh_sum"] = int(t[0])

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + rank)  # each rank's own data
for _ in range(5):
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
td.barrier()  # no rank tears its group down while a peer still uses it
td.destroy_process_group()
print("FACTS", " ".join(f"{k}={v}" for k, v in sorted(facts.items())))
print("WEIGHTS", weights.hex())
end_if_torch_gloo(backend)
