"""DeepSpeed ZeRO-2 and torch DDP: the heads ``use_in_trl`` installs and ``patch_model`` equal TRL's own
heads (or the model's own loss) under the same wrapper, and the plain model, over two optimizer steps.

Under both, every rank holds whole parameters (ZeRO-2 partitions only gradients and optimizer state), so
nothing is gathered; what is tested is that the gradients our heads form (in the forward on the chunked
path, in the backward on the recompute path) reach the wrapper's reduction: DeepSpeed's
reduce-scatter, DDP's bucketed all-reduce, which both hook the parameters' gradient accumulation.

One spawn of 2 processes per setup runs all its cases (each spawn pays a process start and the
imports). On the CPU: DeepSpeed's CPU accelerator over gloo for ZeRO-2, gloo for DDP, the kernels
under the Triton interpreter, fp32 (bf16 is not exercised here: the kernels' bf16 is covered by the
kernel tests, and on the CPU the package emulates bf16 ``tl.dot``, Triton issue 11584). With 2 CUDA GPUs
the same runs go over NCCL, a GPU per rank; with fewer they are skipped. The model, batches and loss
functions are test_zero3.py's (a tiny untied Llama whose head has a bias, random init, no download).
"""

import functools

import pytest
import torch

import test_zero3 as zero3
from test_parallel import _exit_cleanly, free_port

WORLD = 2


def _spawn(fn):
    if zero3.ON_GPU and torch.cuda.device_count() < WORLD:
        pytest.skip(f"{WORLD} ranks need {WORLD} GPUs")
    torch.multiprocessing.spawn(fn, args=(WORLD, free_port()), nprocs=WORLD, join=True)


def _count_our_head_calls():
    """Counts the calls of the LM head ``use_in_trl`` installs (so that a missed install fails)."""
    import fused_linear_ce.trl_head as trl_head

    calls, real = [], trl_head.chunked_log_probs

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    trl_head.ChunkedLogProbFunction.apply = staticmethod(counted)
    return calls


def _head_cases():
    """(name, loss_fn): TRL's fused LM head, SFT's loss and GRPO's per-token log-probs and entropy under
    an arbitrary upstream gradient."""
    return [("sft", functools.partial(zero3._fused_head_loss, "sft")),
            ("grpo", functools.partial(zero3._fused_head_loss, "grpo"))]


# --- DeepSpeed ZeRO-2 ----------------------------------------------------------------------------------


def _zero2_worker(rank, world, port):
    zero3._init(rank, world, port)
    import fused_linear_ce
    import trl.trainer.distillation_trainer as trainer

    calls = _count_our_head_calls()
    run = functools.partial(zero3._engine_run, stage=2)
    for name, loss_fn in _head_cases():
        mine, theirs, plain = zero3._run_three(loss_fn, install=True, stage=2)
        zero3._assert_close(mine, theirs, what=f"{name}: ours vs TRL's on the ZeRO-2 engine")
        zero3._assert_close(mine, plain, what=f"{name}: ours on the ZeRO-2 engine vs the plain model")
    assert calls, "our head was not called"

    # The DistillationTrainer loss at beta 0.5, the teacher under its own engine: at stage 0, as TRL's
    # prepare_deepspeed gives a teacher when the run is not ZeRO-3 (ZeRO-2 would require an optimizer).
    teacher = zero3._engine(zero3._model(48, 7), train=False, stage=0)
    plain_teacher = zero3._model(48, 7).to(zero3._device()).eval()
    for name, per_token in (("loss", None), ("per-token head", trainer._chunked_divergence_loss)):
        theirs = run(zero3._model(32, 0), functools.partial(zero3._distill_loss, 0.5, per_token, teacher))
        replaced = fused_linear_ce.use_in_trl()
        try:
            mine = run(zero3._model(32, 0), functools.partial(zero3._distill_loss, 0.5, per_token, teacher))
            plain = zero3._plain_run(zero3._model(32, 0),
                                     functools.partial(zero3._distill_loss, 0.5, per_token, plain_teacher))
        finally:
            replaced.restore()
        zero3._assert_close(mine, theirs, what=f"distillation {name}: ours vs TRL's on the ZeRO-2 engine")
        zero3._assert_close(mine, plain, what=f"distillation {name}: ZeRO-2 engine vs the plain model")

    # patch_model against the model's own loss (materialised logits).
    theirs = run(zero3._model(32, 0), zero3._own_loss)
    mine = run(fused_linear_ce.patch_model(zero3._model(32, 0)), zero3._own_loss)
    plain = zero3._plain_run(fused_linear_ce.patch_model(zero3._model(32, 0)), zero3._own_loss)
    zero3._assert_close(mine, theirs, what="patch_model vs the model's own loss on the ZeRO-2 engine")
    zero3._assert_close(mine, plain, what="patch_model on the ZeRO-2 engine vs the plain model")
    _exit_cleanly()


def test_zero2_trl_heads_and_patch_model_equal_trls_own_and_the_plain_model():
    _spawn(_zero2_worker)


# --- torch DistributedDataParallel ----------------------------------------------------------------------


def _same_on_every_rank(grads, what):
    """Each gradient equals rank 0's (DDP all-reduced it)."""
    import torch.distributed as dist

    for name, g in grads.items():
        first = g.clone()
        dist.broadcast(first, src=0)
        assert torch.equal(g, first), (what, "grad differs across ranks", name)


def _ddp_run(model, loss_fn, steps=2, what=""):
    """``model`` wrapped in DDP (patched before wrapping where it is), the loss computed inside the
    wrapped forward (loss_fn(ddp, module)), plain SGD: (losses, first grads, final params)."""
    from torch.nn.parallel import DistributedDataParallel

    model = model.to(zero3._device())
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if zero3.ON_GPU else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=zero3.LR)
    losses, first = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(ddp, model)
        loss.backward()
        losses.append(loss.detach().cpu())
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        _same_on_every_rank({n: p.grad for n, p in model.named_parameters()}, what)
        first = first or grads
        optimizer.step()
    return losses, first, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _averaged_run(model, loss_fn, steps=2):
    """The plain model on this rank's batch, its gradients averaged over the ranks by hand (what DDP
    does), plain SGD: (losses, first grads, final params)."""
    import torch.distributed as dist

    model = model.to(zero3._device())
    optimizer = torch.optim.SGD(model.parameters(), lr=zero3.LR)
    losses, first = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model, model)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        losses.append(loss.detach().cpu())
        first = first or {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        optimizer.step()
    return losses, first, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _ddp_worker(rank, world, port):
    zero3._init(rank, world, port)
    import fused_linear_ce
    import trl.trainer.distillation_trainer as trainer

    zero3.BATCH_SEED = 1 + rank  # each rank its own batch, so that the all-reduce matters
    calls = _count_our_head_calls()
    teacher = zero3._model(48, 7).to(zero3._device()).eval()
    cases = _head_cases() + [
        ("distillation loss", functools.partial(zero3._distill_loss, 0.5, None, teacher)),
        ("distillation per-token head",
         functools.partial(zero3._distill_loss, 0.5, trainer._chunked_divergence_loss, teacher))]
    for name, loss_fn in cases:
        theirs = _ddp_run(zero3._model(32, 0), loss_fn, what=name)
        replaced = fused_linear_ce.use_in_trl()
        try:
            mine = _ddp_run(zero3._model(32, 0), loss_fn, what=name)
            plain = _averaged_run(zero3._model(32, 0), loss_fn)
        finally:
            replaced.restore()
        zero3._assert_close(mine, theirs, what=f"{name}: ours vs TRL's under DDP")
        zero3._assert_close(mine, plain, what=f"{name}: ours under DDP vs the plain model averaged")
    assert calls, "our head was not called"

    # patch_model, patched before wrapping, both strategies (gradients formed in the forward on the
    # chunked path "auto" takes here; in the backward on the recompute path).
    theirs = _ddp_run(zero3._model(32, 0), zero3._own_loss, what="own loss")
    for strategy in ("auto", "recompute"):
        mine = _ddp_run(fused_linear_ce.patch_model(zero3._model(32, 0), strategy=strategy), zero3._own_loss,
                        what=strategy)
        plain = _averaged_run(fused_linear_ce.patch_model(zero3._model(32, 0), strategy=strategy), zero3._own_loss)
        zero3._assert_close(mine, theirs, what=f"patch_model {strategy} vs the model's own loss under DDP")
        zero3._assert_close(mine, plain, what=f"patch_model {strategy} under DDP vs the plain model averaged")
    _exit_cleanly()


def test_ddp_trl_heads_and_patch_model_equal_trls_own_and_the_plain_model():
    _spawn(_ddp_worker)
