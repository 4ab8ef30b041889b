"""PyTorch Lightning's DDPStrategy, the backend by name, 2 CPU processes launched by
Lightning itself (it starts the second one):

    python lightning_train.py BACKEND OUT

With BACKEND "collectives" the program imports collectives (plain ``import collectives``)
and names the backend; with "gloo" it is torch's own run. Each rank writes its trained
weights to OUT.rank<r>.
"""
import sys

import torch

backend, out = sys.argv[1], sys.argv[2]
if backend == "collectives":
    import collectives  # noqa: F401  (registers the name with torch.distributed)
import lightning as L  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import BATCH, dataset, end_if_torch_gloo, model, write_weights  # noqa: E402


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


module = Module()
trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1,
                    strategy=DDPStrategy(process_group_backend=backend),
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, use_distributed_sampler=True)
loader = torch.utils.data.DataLoader(dataset(2), batch_size=BATCH, shuffle=False)
trainer.fit(module, loader)
import torch.distributed as td  # noqa: E402
assert td.get_backend() == backend, td.get_backend()
write_weights(out, trainer.global_rank, module.net)
td.barrier()  # no rank tears its group down while a peer still uses it
td.destroy_process_group()
end_if_torch_gloo(backend)
