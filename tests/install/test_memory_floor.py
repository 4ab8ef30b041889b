"""bench/memory_floor_pg.py: the FSDP2 floor that does the collectives' memory work does it
(every all_gather block written, the reduce_scatter's blocks summed), and nothing with
``work=False``; DDP's memory-floor hook leaves the gradients as they were. Called directly
on one group object or bucket: no ranks, no communication."""
import os
import sys

import pytest

from tests.support.ranks import ROOT
from tests.support.requires import needs_torch

pytestmark = needs_torch
sys.path.insert(0, os.path.join(ROOT, "bench"))


@pytest.fixture
def floor_pg():
    import memory_floor_pg
    return memory_floor_pg.MemoryFloorGroup


@pytest.mark.parametrize("n", [0, 1, 7])
def test_all_gather_writes_every_block(floor_pg, n):
    import torch
    pg = floor_pg(1, 3)
    inp = torch.arange(n, dtype=torch.float32) + 1
    out = torch.full((3 * n,), -1.0)
    work = pg.all_gather_single(out, inp)
    assert work.wait() and work.is_completed()
    assert torch.equal(out, inp.repeat(3))
    assert work.get_future().wait()[0] is out


def test_all_gather_in_place_leaves_its_own_block(floor_pg):
    import torch
    pg = floor_pg(1, 3)
    out = torch.zeros(12)
    mine = out[4:8]
    mine.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    pg.all_gather_single(out, mine)
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0, 4.0]).repeat(3))


def test_reduce_scatter_sums_the_blocks(floor_pg):
    import torch
    pg = floor_pg(0, 3)
    inp = torch.arange(15, dtype=torch.float32)
    out = torch.zeros(5)
    pg.reduce_scatter_single(out, inp)
    assert torch.equal(out, inp.reshape(3, 5).sum(0))


def test_without_work_nothing_is_written(floor_pg):
    import torch
    pg = floor_pg(0, 2)
    pg.work = False
    out = torch.zeros(4)
    pg.all_gather_single(out, torch.ones(2))
    pg.reduce_scatter_single(out[:2], torch.ones(4))
    assert torch.equal(out, torch.zeros(4))


class _Bucket:
    """What ddp_hook reads of DDP's GradBucket."""

    def __init__(self, buf):
        self._buf = buf

    def buffer(self):
        return self._buf


def test_ddp_hook_keeps_the_gradients():
    import memory_floor_pg
    import torch
    grads = torch.linspace(-3.0, 3.0, 11)
    fut = memory_floor_pg.ddp_hook(memory_floor_pg.DdpHookState(), _Bucket(grads.clone()))
    assert torch.equal(fut.wait(), grads)
