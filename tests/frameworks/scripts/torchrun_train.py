"""A torch.distributed program started by torchrun that names the backend and never
imports collectives (torch's ``torch.backends`` entry point registers the name):

    torchrun --nproc-per-node 2 torchrun_train.py BACKEND OUT
"""
import os
import sys

import torch
import torch.distributed as td

backend, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, dataset, end_if_torch_gloo, model, write_weights  # noqa: E402

td.init_process_group(backend)
assert td.get_backend() == backend
rank, world = td.get_rank(), td.get_world_size()
net = model()
ddp = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = dataset(world)
sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
for x, y in torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler):
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
assert "collectives" in sys.modules or backend != "collectives"  # the bridge, loaded at init
write_weights(out, rank, net)
td.barrier()  # no rank tears its group down while a peer still uses it
td.destroy_process_group()
end_if_torch_gloo(backend)
