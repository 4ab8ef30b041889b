"""The nccl backend: a clear error where it cannot run; CUDA tensors where it can."""
from datetime import timedelta

import pytest

import collectives as dist
from collectives.backends import nccl

needs_gpu = pytest.mark.skipif(not nccl.is_available(),
                               reason="needs a CUDA device and libnccl (none on this machine)")


def test_availability_agrees_with_the_front_end():
    assert dist.is_nccl_available() == nccl.is_available()


@pytest.mark.skipif(nccl.is_available(), reason="NCCL is available here; the error path is not reachable")
def test_asking_for_nccl_without_a_gpu_names_what_is_missing():
    with pytest.raises(RuntimeError, match="nccl backend needs"):
        nccl.create_nccl_backend(dist.HashStore(), 0, 1, 10.0)


@needs_gpu
@pytest.mark.timeout(120)
def test_single_rank_collectives_on_cuda_tensors():
    import torch
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        t = torch.arange(10, dtype=torch.float32, device="cuda")
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        out = torch.empty(10, device="cuda")
        dist.all_gather_into_tensor(out, t)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.arange(10, dtype=torch.float32))
        h = torch.ones(4, dtype=torch.bfloat16, device="cuda")
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        assert h.cpu().tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()
