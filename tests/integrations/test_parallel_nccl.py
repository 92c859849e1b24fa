"""Vocabulary parallelism and data parallelism on two GPUs with NCCL: 2 ranks, one GPU each,
started by the test. The sharded loss at the S1 shape (N=8192, H=4096, V=128256, bf16), on both
gradient paths, against the single-GPU result on the unsharded weight computed on each rank's own
GPU; and the DDP / FSDP2 example against one process. The gloo versions of these (CPU, in CI) are
in ``test_parallel.py``."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import rel_err
from test_parallel import check_data_parallel_example, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

S1 = (8192, 4096, 128256)


def _spawn(fn, *args):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on shared hosts
    mp.spawn(fn, args=(2, free_port(), *args), nprocs=2, join=True)


def _init(rank, world, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def _inputs(n, h, v, device):
    """The same values on every rank (a seeded generator on each rank's GPU), logits of std ~2,
    a fifth of the rows ignored, and rows 1024-2047 too (whole row blocks, which skip their logit
    tiles on both ranks)."""
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) * (4.0 / h) ** 0.5).bfloat16()
    bias = torch.randn(v, device=device, generator=g).bfloat16()
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    targets[torch.rand(n, device=device, generator=g) < 0.2] = -100
    targets[1024:2048] = -100
    return hidden, weight, bias, targets


def _run(hidden, weight, bias, targets, kwargs, group=None):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss, metrics = fused_linear_cross_entropy_(leaves, targets, kwargs, group)
    if loss.ndim:
        g = torch.Generator(device=loss.device).manual_seed(5)
        loss.backward(torch.rand(loss.shape, device=loss.device, generator=g) + 0.5)
    else:
        loss.backward()
    return loss.detach(), metrics, [t.grad for t in leaves]


def fused_linear_cross_entropy_(leaves, targets, kwargs, group):
    from fused_linear_ce import fused_linear_cross_entropy

    return fused_linear_cross_entropy(leaves[0], leaves[1], targets, leaves[2], return_metrics=True,
                                      process_group=group, **kwargs)


PATHS = {
    "recompute-none": dict(strategy="recompute", reduction="none", logit_scale=0.8, softcap=30.0),
    "chunked-mean": dict(strategy="chunked", reduction="mean", label_smoothing=0.1),
}


def _sharded_worker(rank, world, port, path):
    _init(rank, world, port)
    try:
        device = torch.device("cuda", rank)
        hidden, weight, bias, targets = _inputs(*S1, device)
        kwargs = PATHS[path]
        full = _run(hidden, weight, bias, targets, kwargs)
        v_local = S1[2] // world
        shard = slice(rank * v_local, (rank + 1) * v_local)
        part = _run(hidden, weight[shard].contiguous(), bias[shard].contiguous(), targets, kwargs, dist.group.WORLD)
        assert rel_err(part[0], full[0]) < 1e-5, f"loss: {rel_err(part[0], full[0])}"
        for k in ("num_correct", "num_counted"):
            assert part[1][k].item() == full[1][k].item(), k
        assert abs(part[1]["entropy"].item() - full[1]["entropy"].item()) < 1e-5 * abs(full[1]["entropy"].item())
        # bf16 gradients: the shards sum in another order (fp32) before the one rounding to bf16.
        errs = dict(hidden=rel_err(part[2][0], full[2][0]), weight=rel_err(part[2][1], full[2][1][shard]),
                    bias=rel_err(part[2][2], full[2][2][shard]))
        assert all(e < 4e-3 for e in errs.values()), errs
        # Every rank holds the same full grad_hidden (already all-reduced by the loss).
        other = part[2][0].clone()
        dist.broadcast(other, src=0)
        assert torch.equal(other, part[2][0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", list(PATHS))
def test_vocabulary_parallel_on_two_gpus_equals_one_gpu_at_s1(path):
    _spawn(_sharded_worker, path)


def _data_parallel_worker(rank, world, port, mode):
    _init(rank, world, port)
    try:
        check_data_parallel_example(mode, torch.device("cuda", rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_example_on_two_gpus_equals_one_gpu(mode):
    _spawn(_data_parallel_worker, mode)
