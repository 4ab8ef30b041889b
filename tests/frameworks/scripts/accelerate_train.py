"""Hugging Face accelerate on the CPU with collectives' group made first, 2 processes
started by ``accelerate launch``:

    accelerate launch --multi_gpu --num_processes 2 ... accelerate_train.py BACKEND OUT

(``--multi_gpu`` makes accelerate start the processes through torchrun; ``--cpu`` would
start one. The script's ``Accelerator(cpu=True)`` keeps them on the CPU.)

accelerate accepts only gloo or mpi on the CPU; with BACKEND "collectives" the program
calls ``collectives.init_process_group("gloo")`` before ``Accelerator(cpu=True)``, which
then joins that group (torch's default group, run by collectives). With "gloo" accelerate
makes torch's own gloo group.
"""
import os
import sys

import torch

backend, out = sys.argv[1], sys.argv[2]
if backend == "collectives":
    import collectives
    collectives.init_process_group("gloo")
from accelerate import Accelerator  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, dataset, end_if_torch_gloo, model, write_weights  # noqa: E402

accelerator = Accelerator(cpu=True)
import torch.distributed as td  # noqa: E402
assert td.get_backend() == ("collectives" if backend == "collectives" else "gloo"), td.get_backend()
net = model()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(dataset(accelerator.num_processes), batch_size=BATCH,
                                     shuffle=False)
ddp, opt, loader = accelerator.prepare(net, opt, loader)
for x, y in loader:
    opt.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(ddp(x), y))
    opt.step()
write_weights(out, accelerator.process_index, accelerator.unwrap_model(ddp))
accelerator.wait_for_everyone()  # no rank tears its group down while a peer still uses it
accelerator.end_training()  # (destroys the process group)
end_if_torch_gloo(backend)
