"""Vocabulary parallelism over torch.distributed (gloo on CPU here, NCCL on GPUs): 2 and 3 processes
started by the test, each holding a contiguous shard of the vocabulary; every result must equal the
single-process result on the unsharded weight. Also DDP and FSDP2 data parallelism with the loss."""

import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cases import Case, class_weights, make_inputs
from conftest import ON_GPU, rel_err
from fused_linear_ce import fused_linear_cross_entropy, fused_linear_divergence, fused_linear_logprobs

# The workers run the Triton interpreter on CPU tensors with gloo; on a CUDA machine the kernels are
# compiled for the GPU at import, so these CPU tests do not apply there. The NCCL versions (2 GPUs)
# are in test_parallel_nccl.py.
pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU/gloo tests (Triton interpreter in the workers)")

SHARDED_CASES = [
    dict(reduction="mean", return_metrics=True),
    dict(reduction="none", ignored=0.2, bias=True, logit_scale=0.7, softcap=3.0),
    dict(reduction="sum", ignored=0.2, label_smoothing=0.1, z_loss=1e-3, class_weight=True, return_metrics=True),
    dict(reduction="mean", dtype=torch.bfloat16, bias=True, return_metrics=True, chunk_bytes=16 * 96 * 2),
    # Each shard's grad_hidden accumulator borrowed from its grad_weight, all-reduced in place there.
    dict(reduction="none", dtype=torch.bfloat16, ignored=0.2, bias=True, shape=(23, 160, 1200),
         chunk_bytes=23 * 256 * 2),
    # Each shard's grad_hidden accumulator half hosted in its grad_hidden, both halves all-reduced.
    dict(reduction="none", dtype=torch.bfloat16, ignored=0.2, bias=True, shape=(23, 160, 2400), chunk_bytes=20000),
    # The chunked path (gradients in the forward, merged per chunk of rows), in one and in two chunks.
    dict(reduction="sum", ignored=0.2, bias=True, label_smoothing=0.1, class_weight=True, return_metrics=True,
         strategy="chunked"),
    dict(reduction="mean", dtype=torch.bfloat16, bias=True, logit_scale=0.7, softcap=3.0, return_metrics=True,
         strategy="chunked", chunk_bytes=16 * 48 * 2),
    # One chunk in each shard's grad_weight (class-major, 16-row slabs; N = 23 <= H = 40 in bf16).
    dict(reduction="mean", dtype=torch.bfloat16, bias=True, ignored=0.2, return_metrics=True, chunk_bytes=16 * 40 * 2,
         strategy="chunked", hosted=True),
    # Rows 16-47 ignored: whole row blocks (16 rows on the interpreter) that skip their logit tiles on
    # every rank (no returned lse, so the recompute path skips too); their neutral statistics merge.
    dict(reduction="mean", blocky=True, return_lse=False, return_metrics=True, shape=(53, 40, 96)),
    dict(reduction="sum", dtype=torch.bfloat16, blocky=True, return_metrics=True, shape=(53, 40, 96),
         strategy="chunked"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world, *args):
    port = free_port()
    mp.spawn(fn, args=(world, port, *args), nprocs=world, join=True)


def _init(rank, world, port, timeout_s=None):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    extra = dict(timeout=datetime.timedelta(seconds=timeout_s)) if timeout_s else {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **extra)


def _exit_cleanly():
    """A worker that passed: leave the group and end the process without running C++ static
    destructors. In the full CPU suite a gloo worker now and then aborted at interpreter exit
    ("terminate called without an active exception", SIGABRT) after its test had passed; a failed
    worker still raises through ``mp.spawn`` as before."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(hidden, weight, bias, targets, cw, kwargs, group=None):
    """Loss, metrics, lse and gradients; the lse is returned (and gets a gradient) except on the
    chunked path, which does not take return_lse, and where the case says ``return_lse=False``."""
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    kwargs = dict(kwargs)
    with_lse = kwargs.pop("return_lse", kwargs.get("strategy") != "chunked")
    out = fused_linear_cross_entropy(leaves[0], leaves[1], targets, leaves[2], class_weight=cw, return_lse=with_lse,
                                     process_group=group, **kwargs)
    loss, *rest = out if isinstance(out, tuple) else (out,)
    metrics = rest[0] if kwargs.get("return_metrics") else None
    lse = rest[-1] if with_lse else torch.zeros(())
    g = torch.Generator().manual_seed(5)
    upstream = torch.rand(loss.shape, generator=g) + 0.5
    (loss * upstream).sum().add((lse * 0.1).sum()).backward()
    return loss.detach(), metrics, lse.detach(), [t.grad if t is not None else None for t in leaves]


def _sharded_worker(rank, world, port, index):
    _init(rank, world, port)
    try:
        spec = dict(SHARDED_CASES[index])
        opts = {k: spec.pop(k) for k in ("return_metrics", "label_smoothing", "z_loss", "chunk_bytes", "strategy",
                                         "return_lse") if k in spec}
        blocky = spec.pop("blocky", False)
        hosted = []
        if spec.pop("hosted", False):  # small slabs; count the hosted calls (the whole and the shard)
            from fused_linear_ce import chunked, plan
            plan.HOSTED_MIN_ROWS = 16
            real = chunked.hosted_weight_grad
            chunked.hosted_weight_grad = lambda *a: hosted.append(a[3]) or real(*a)
        case = Case(*spec.pop("shape", (23, 40, 96)), **{k: v for k, v in spec.items()
                                                         if k in Case.__dataclass_fields__})
        kwargs = dict(reduction=case.reduction, ignore_index=case.ignore_index, logit_scale=case.logit_scale,
                      softcap=case.softcap, **opts)
        hidden, weight, bias, targets = make_inputs(case, device="cpu")
        if blocky:
            targets[16:48] = case.ignore_index
        cw = class_weights(case, device="cpu")
        shard = slice(rank * case.v // world, (rank + 1) * case.v // world)
        full = _run(hidden, weight, bias, targets, cw, kwargs)
        part = _run(hidden, weight[shard].contiguous(), None if bias is None else bias[shard].contiguous(), targets,
                    None if cw is None else cw[shard].contiguous(), kwargs, group=dist.group.WORLD)
        # Every rank is past its last collective before any can leave on a failed assertion (a rank
        # that exits while a peer is still inside an all-reduce makes gloo abort that peer, and the
        # abort, not the assertion, is what the test would report).
        dist.barrier()
        tol = 1e-5 if case.dtype == torch.float32 else 1e-2
        assert rel_err(part[0], full[0]) < 1e-5, "loss"
        if "hosted" in SHARDED_CASES[index]:
            assert hosted == [16, 16], hosted
        assert rel_err(part[2], full[2]) < 1e-6, "lse"
        if full[1] is not None:
            for k in full[1]:
                assert abs(part[1][k].item() - full[1][k].item()) <= 1e-5 * (1 + abs(full[1][k].item())), k
        assert rel_err(part[3][0], full[3][0]) < tol, "grad_hidden (full on every rank)"
        assert rel_err(part[3][1], full[3][1][shard]) < tol, "grad_weight shard"
        if bias is not None:
            assert rel_err(part[3][2], full[3][2][shard]) < tol, "grad_bias shard"
        if blocky:  # rows 16-47 count for nothing: exactly zero gradient on every rank
            assert torch.equal(part[3][0][16:48], torch.zeros_like(part[3][0][16:48])), "ignored rows"
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("index", range(len(SHARDED_CASES)), ids=lambda i: "-".join(
    f"{k}={v}" for k, v in SHARDED_CASES[i].items()))
def test_vocabulary_parallel_equals_single_process(world, index):
    _spawn(_sharded_worker, world, index)


TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _token_run(hidden, weight, bias, targets, kwargs, group=None):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = fused_linear_logprobs(leaves[0], leaves[1], targets, leaves[2], outputs=TOKEN_FIELDS, process_group=group,
                                **kwargs)
    g = torch.Generator().manual_seed(5)
    (out["log_probs"] * torch.randn(targets.shape, generator=g) + out["entropy"] * torch.randn(
        targets.shape, generator=g)).sum().backward()
    return out, [t.grad for t in leaves]


def _token_worker(rank, world, port, strategy):
    """fused_linear_logprobs on a vocabulary shard: every field, and both gradients, as on the whole."""
    _init(rank, world, port)
    try:
        case = Case(23, 40, 96, ignored=0.2, bias=True)
        hidden, weight, bias, targets = make_inputs(case, device="cpu")
        kwargs = dict(temperature=0.8, logit_scale=1.2, strategy=strategy)
        shard = slice(rank * case.v // world, (rank + 1) * case.v // world)
        full, full_grads = _token_run(hidden, weight, bias, targets, kwargs)
        part, part_grads = _token_run(hidden, weight[shard].contiguous(), bias[shard].contiguous(), targets, kwargs,
                                      group=dist.group.WORLD)
        dist.barrier()
        for name in TOKEN_FIELDS[:-1]:
            assert rel_err(part[name], full[name]) < 1e-5, name
        assert torch.equal(part["is_top1"], full["is_top1"])
        assert rel_err(part_grads[0], full_grads[0]) < 1e-5, "grad_hidden (full on every rank)"
        assert rel_err(part_grads[1], full_grads[1][shard]) < 1e-5, "grad_weight shard"
        assert rel_err(part_grads[2], full_grads[2][shard]) < 1e-5, "grad_bias shard"
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_per_token_outputs_on_vocabulary_shards_equal_the_whole(strategy):
    _spawn(_token_worker, 2, strategy)


def _master_run(api, hidden, weight, targets, group=None):
    """Under bf16 autocast with an fp32 weight (a master weight): the loss (auto: the chunked path,
    which a master weight takes at any N) or the per-token log-probs and entropy on the recompute
    path, and the gradients."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if api.startswith("loss"):
            # "loss-chunks": several chunks, whose weight gradient is summed unscaled and scaled once
            chunk_bytes = 16 * weight.shape[0] * 2 if api == "loss-chunks" else None
            out = fused_linear_cross_entropy(h, w, targets, process_group=group, chunk_bytes=chunk_bytes)
        else:
            fields = fused_linear_logprobs(h, w, targets, outputs=("log_probs", "entropy"), process_group=group,
                                           strategy="recompute")
            out = (fields["entropy"] - 2 * fields["log_probs"]).sum()
    out.backward()
    return out.detach(), h.grad, w.grad


def _master_worker(rank, world, port, api):
    """An fp32 weight shard under bf16 autocast: the fp32 weight gradient of each shard, and the loss
    and the all-reduced hidden gradient, as on the whole fp32 weight."""
    _init(rank, world, port)
    try:
        hidden, weight, _, targets = make_inputs(Case(23, 40, 96, ignored=0.2), device="cpu")
        shard = slice(rank * 96 // world, (rank + 1) * 96 // world)
        full = _master_run(api, hidden, weight, targets)
        part = _master_run(api, hidden, weight[shard].contiguous(), targets, group=dist.group.WORLD)
        dist.barrier()
        assert part[2].dtype == torch.float32
        assert rel_err(part[0], full[0]) < 1e-5, "loss"
        assert rel_err(part[1], full[1]) < 1e-2, "grad_hidden (bf16, full on every rank)"
        assert rel_err(part[2], full[2][shard]) < 1e-2, "grad_weight shard (fp32)"
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


@pytest.mark.parametrize("api", ["loss", "loss-chunks", "per-token"])
def test_an_fp32_master_weight_on_vocabulary_shards_equals_the_whole(api):
    _spawn(_master_worker, 2, api)


def _unequal_worker(rank, world, port):
    _init(rank, world, port)
    try:
        hidden, weight, _, targets = make_inputs(Case(5, 16, 30), device="cpu")
        with pytest.raises(ValueError, match="equal sizes"):
            fused_linear_cross_entropy(hidden, weight[: 10 + rank], targets, process_group=dist.group.WORLD)
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


def test_unequal_shards_raise():
    _spawn(_unequal_worker, 2)


# Shard sizes per call and rank: equal, then unequal after an equal call of rank 0's size, then
# equal at a new size, then unequal with rank 1 at a size seen before. Every rank must take the same
# collectives on every call: an unequal call raises on every rank, and none waits for another.
SIZE_SEQUENCE = [(10, 10), (10, 11), (12, 12), (13, 12), (10, 10)]


def _size_sequence_worker(rank, world, port):
    _init(rank, world, port, timeout_s=60)  # a rank left waiting fails the test instead of hanging it
    try:
        hidden, weight, _, targets = make_inputs(Case(5, 16, 30), device="cpu")
        targets = targets % 20  # class ids inside every equal split's vocabulary
        for sizes in SIZE_SEQUENCE:
            call = lambda: fused_linear_cross_entropy(hidden, weight[: sizes[rank]], targets,  # noqa: E731
                                                      process_group=dist.group.WORLD)
            if len(set(sizes)) > 1:
                with pytest.raises(ValueError, match="equal sizes"):
                    call()
            else:
                assert torch.isfinite(call())
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


def test_shard_sizes_changing_between_calls_raise_on_every_rank_and_never_hang():
    _spawn(_size_sequence_worker, 2)


def _group_type_worker(rank, world, port):
    _init(rank, world, port, timeout_s=60)
    try:
        hidden, weight, _, targets = make_inputs(Case(5, 16, 30), device="cpu")
        for wrong in ("world", dist.group, 0):
            with pytest.raises(TypeError, match="ProcessGroup"):
                fused_linear_cross_entropy(hidden, weight, targets, process_group=wrong)
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


def test_a_wrong_typed_process_group_raises_a_clear_error():
    _spawn(_group_type_worker, 2)


def _dtensor_worker(rank, world, port):
    """A vocabulary-sharded DTensor weight (as FSDP2 or tensor parallelism hold it): refused with a
    message naming what to pass, and what it names (the local shard and the mesh's group) gives the
    full-vocabulary result."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init(rank, world, port, timeout_s=60)
    try:
        hidden, weight, _, targets = make_inputs(Case(6, 16, 40), device="cpu")
        mesh = init_device_mesh("cpu", (world,))
        sharded = distribute_tensor(weight, mesh, [Shard(0)])
        with pytest.raises(TypeError, match=r"weight is a DTensor.*to_local\(\).*process_group=mesh.get_group"):
            fused_linear_cross_entropy(hidden, sharded, targets)
        with pytest.raises(TypeError, match="hidden is a DTensor"):
            fused_linear_cross_entropy(distribute_tensor(hidden, mesh, [Shard(0)]), weight, targets)
        # the divergence (one validation of a head): each model's tensors, the whole vocabulary only
        with pytest.raises(TypeError, match=r"student_weight is a DTensor.*no process_group.*full_tensor"):
            fused_linear_divergence(hidden, sharded, hidden, weight, beta=0.5)
        with pytest.raises(TypeError, match=r"teacher_weight is a DTensor"):
            fused_linear_divergence(hidden, weight, hidden, sharded, beta=0.5)
        got = fused_linear_cross_entropy(hidden, sharded.to_local(), targets, process_group=mesh.get_group())
        want = fused_linear_cross_entropy(hidden, weight, targets)
        assert rel_err(got, want) < 1e-6
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


def test_dtensor_inputs_raise_with_what_to_pass_and_that_works():
    _spawn(_dtensor_worker, 2)


def check_data_parallel_example(mode, device):
    """Runs ``examples/data_parallel.py``'s step on this rank (the process group already up) and
    checks the global loss and the full gradients against one process on the whole batch, with the
    plain mean loss. Shared with the NCCL test (``test_parallel_nccl.py``)."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("data_parallel_example", REPO / "examples" / "data_parallel.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loss, grads = example.train_step(mode, device=device)
    torch.manual_seed(0)
    single = example.TinyLM().to(device)
    ids, labels = (t.to(device) for t in example.batch(0))
    ref = single(ids, labels, example.global_count(labels), 1)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
    for name, p in single.named_parameters():
        assert rel_err(grads[name], p.grad) < 1e-5, name


def _data_parallel_worker(rank, world, port, mode):
    _init(rank, world, port)
    try:
        check_data_parallel_example(mode, torch.device("cpu"))
    except BaseException:
        dist.destroy_process_group()
        raise
    _exit_cleanly()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_example_equals_one_process(mode):
    _spawn(_data_parallel_worker, 2, mode)
