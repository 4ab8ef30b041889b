"""The torch.distributed tutorial programs (pytorch.org/tutorials/intermediate/dist_tuto.html,
/work/shared/seeds/001_*.txt) run as scripts, with only the import line changed.

Each program is the tutorial's: ``init_process`` sets MASTER_ADDR/MASTER_PORT and calls
``dist.init_process_group('gloo', rank=rank, world_size=size)`` in processes started
with ``torch.multiprocessing`` (spawn). The one other change: MASTER_PORT comes from
TUTORIAL_PORT so that parallel runs do not collide on 29500. The synchronous SGD
program runs twice, under ``torch.distributed`` and under ``collectives``, and its
final parameters must match.
"""
import os
import subprocess
import sys

import pytest
import collectives
from tests.support import ROOT
from tests.support.ranks import free_port

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="the tutorial programs are torch programs")

TORCH_IMPORT = "import torch.distributed as dist"
OUR_IMPORT = "import collectives as dist"

needs_gloo = pytest.mark.skipif(not collectives.is_gloo_available(),
                                reason="collectives' gloo backend (collectives/backends/tcp) is absent")

MAIN = '''
import os
import sys
from math import ceil
from random import Random

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
{IMPORT}


def init_process(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ['MASTER_PORT'] = os.environ.get('TUTORIAL_PORT', '29500')
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()

{BODY}

if __name__ == "__main__":
    size = int(os.environ.get('TUTORIAL_SIZE', '2'))
    processes = []
    mp.set_start_method("spawn")
    for rank in range(size):
        p = mp.Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    sys.exit(max(p.exitcode for p in processes))
'''

BLOCKING_P2P = '''
"""Blocking point-to-point communication."""

def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print('Rank ', rank, ' has data ', tensor[0], flush=True)
'''

NONBLOCKING_P2P = '''
"""Non-blocking point-to-point communication."""

def run(rank, size):
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print('Rank 0 started sending', flush=True)
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print('Rank 1 started receiving', flush=True)
    req.wait()
    print('Rank ', rank, ' has data ', tensor[0], flush=True)
'''

GROUP_ALL_REDUCE = '''
""" All-Reduce example."""
def run(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0], flush=True)
'''

RING_ALL_REDUCE = '''
""" Implementation of a ring-reduce with addition. """
def allreduce(send, recv):
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def run(rank, size):
    send = torch.arange(4, dtype=torch.float32) + 10 * rank
    recv = torch.zeros(4)
    allreduce(send, recv)
    print('Rank ', rank, ' has data ', recv.tolist(), flush=True)
'''

SGD = '''
""" Dataset partitioning helper """
class Partition(object):

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner(object):

    def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


class Net(nn.Module):
    """ A small network (the tutorial trains a ConvNet on MNIST; the data here is synthetic). """

    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 20, generator=g)
    w = torch.randn(20, 4, generator=g)
    y = (x @ w).argmax(dim=1)
    return [(x[i], y[i]) for i in range(len(x))]


""" Partitioning the synthetic dataset """
def partition_dataset():
    dataset = synthetic_dataset()
    size = dist.get_world_size()
    bsz = 128 // size
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition,
                                         batch_size=bsz,
                                         shuffle=True)
    return train_set, bsz


""" Gradient averaging. """
def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


""" Distributed Synchronous SGD Example """
def run(rank, size):
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset()
    model = Net()
    optimizer = optim.SGD(model.parameters(),
                          lr=0.01, momentum=0.5)

    num_batches = ceil(len(train_set.dataset) / float(bsz))
    for epoch in range(10):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print('Rank ', dist.get_rank(), ', epoch ',
              epoch, ': ', epoch_loss / num_batches, flush=True)
    torch.save([p.detach() for p in model.parameters()], os.environ['TUTORIAL_OUT'] + f'.{rank}')
'''


def run_program(tmp_path, body, import_line, size=2, name="prog"):
    path = tmp_path / f"{name}.py"
    path.write_text(MAIN.replace("{IMPORT}", import_line).replace("{BODY}", body))
    env = dict(os.environ, TUTORIAL_PORT=str(free_port()), TUTORIAL_SIZE=str(size),
               TUTORIAL_OUT=str(tmp_path / f"{name}.params"), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONUNBUFFERED", None)  # buffered: each print reaches the pipe in one write
    proc = subprocess.run([sys.executable, str(path)], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def lines_of(stdout):
    return sorted(" ".join(line.split()) for line in stdout.splitlines() if line.strip())


@needs_gloo
@pytest.mark.timeout(300)
def test_blocking_point_to_point(tmp_path):
    out = lines_of(run_program(tmp_path, BLOCKING_P2P, OUR_IMPORT))
    assert out == ["Rank 0 has data tensor(1.)", "Rank 1 has data tensor(1.)"]


@needs_gloo
@pytest.mark.timeout(300)
def test_non_blocking_point_to_point(tmp_path):
    out = lines_of(run_program(tmp_path, NONBLOCKING_P2P, OUR_IMPORT))
    assert out == ["Rank 0 has data tensor(1.)", "Rank 0 started sending",
                   "Rank 1 has data tensor(1.)", "Rank 1 started receiving"]


@needs_gloo
@pytest.mark.timeout(300)
def test_group_all_reduce(tmp_path):
    out = lines_of(run_program(tmp_path, GROUP_ALL_REDUCE, OUR_IMPORT))
    assert out == ["Rank 0 has data tensor(2.)", "Rank 1 has data tensor(2.)"]


@needs_gloo
@pytest.mark.timeout(300)
def test_hand_written_ring_all_reduce_on_four_ranks(tmp_path):
    out = lines_of(run_program(tmp_path, RING_ALL_REDUCE, OUR_IMPORT, size=4))
    want = [60.0, 64.0, 68.0, 72.0]  # sum over ranks of arange(4) + 10 * rank
    assert out == [f"Rank {r} has data {want}" for r in range(4)]


@needs_gloo
@pytest.mark.timeout(600)
@pytest.mark.parametrize("size", [2, 3])
def test_synchronous_sgd_matches_torch_distributed(tmp_path, size):
    ours = run_program(tmp_path, SGD, OUR_IMPORT, size, name="ours")
    theirs = run_program(tmp_path, SGD, TORCH_IMPORT, size, name="with_torch")
    if size == 2:  # the printed losses too
        assert lines_of(ours) == lines_of(theirs)
    for r in range(size):
        p_ours = torch.load(tmp_path / f"ours.params.{r}")
        p_torch = torch.load(tmp_path / f"with_torch.params.{r}")
        for a, b in zip(p_ours, p_torch):
            # two ranks: a + b is exact either way, so bitwise; three: summation order may differ
            if size == 2:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # every rank ends with the same parameters
    first = torch.load(tmp_path / "ours.params.0")
    for r in range(1, size):
        for a, b in zip(first, torch.load(tmp_path / f"ours.params.{r}")):
            assert torch.equal(a, b)
