"""DeepSpeed ZeRO-3: the heads ``use_in_trl`` installs and ``patch_model`` gather the partitioned head
weights and biases (forward, and the backward that reads them), and equal TRL's own heads on the same
engine and the unpartitioned model, over two optimizer steps; the public functions refuse a partition.

Each test spawns ``world`` processes (a free loopback port): on the CPU, DeepSpeed's CPU accelerator
over gloo at world sizes 1 and 2 (a partition then holds half of each weight), the kernels under the
Triton interpreter, fp32 (bf16 is not exercised here: the kernels' bf16 is covered by the kernel tests,
and on the CPU the package emulates bf16 ``tl.dot``, Triton issue 11584). With a CUDA GPU the same tests
run over NCCL, each rank on its own GPU (world size 2 needs two GPUs, else it is skipped). The partition
thresholds are 0, so every parameter of a tiny untied Llama (random init, no download) is partitioned;
its head has a bias, so that biases are gathered too.
"""

import functools
import os
import types

import pytest
import torch

from conftest import rel_err
from test_parallel import _exit_cleanly, free_port

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

VOCAB, LR = 64, 0.1
WORLDS = [1, 2]


def _spawn(fn, world, *args):
    if ON_GPU and torch.cuda.device_count() < world:
        pytest.skip(f"world size {world} needs {world} GPUs")
    torch.multiprocessing.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def _init(rank, world, port):
    os.environ.setdefault("TRITON_INTERPRET", "0" if ON_GPU else "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if ON_GPU:
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if ON_GPU else "gloo", auto_mpi_discovery=False)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")


def _model(hidden, seed):
    """A tiny untied Llama in fp32 whose head has a bias."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).float()
    model.lm_head = torch.nn.Linear(hidden, VOCAB, bias=True)
    return model


def _config(stage=3):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0} if stage == 3 else {"stage": stage}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    return config


def _engine(model, train=True, stage=3):
    """``model`` under ZeRO-``stage`` (SGD when ``train``), transformers told so (TRL's gather consults it)."""
    from transformers.integrations import HfDeepSpeedConfig

    config = _config(stage)
    keep = HfDeepSpeedConfig(config)  # noqa: F841 (transformers holds a weak reference)
    model = model.to(_device())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR) if train else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.hf_config = keep
    if not train:
        engine.eval()
    return engine


BATCH_SEED = 1  # a data-parallel test sets its own per rank


def _batch():
    g = torch.Generator().manual_seed(BATCH_SEED)
    ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids.to(_device()), labels.to(_device())


def _full_grads(engine):
    return {n: deepspeed.utils.safe_get_full_grad(p).detach().cpu().clone()
            for n, p in engine.module.named_parameters()}


def _full_params(engine):
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}


def _plain_run(model, loss_fn, steps=2):
    """The unpartitioned model, plain SGD: (losses, first grads, final params)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # transformers (and so TRL's gather) told that ZeRO-3 is off
    model = model.to(_device())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model, model)
        loss.backward()
        losses.append(loss.detach().cpu())
        grads = grads or {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        optimizer.step()
    return losses, grads, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _engine_run(model, loss_fn, steps=2, stage=3):
    """The same under ZeRO-``stage``: the loss computed inside the engine's forward (loss_fn(engine, module))."""
    engine = _engine(model, stage=stage)
    losses, grads = [], None
    for _ in range(steps):
        loss = loss_fn(engine, engine.module)
        engine.backward(loss)
        losses.append(loss.detach().cpu())
        grads = grads or _full_grads(engine)
        engine.step()
    return losses, grads, _full_params(engine)


def _assert_close(mine, theirs, tol=1e-5, what=""):
    losses, grads, params = mine
    assert grads.keys() == theirs[1].keys()
    for name in grads:
        assert rel_err(grads[name], theirs[1][name]) < 20 * tol, (what, "grad", name, rel_err(grads[name], theirs[1][name]))
    for name in grads:
        assert rel_err(params[name], theirs[2][name]) < 20 * tol, (what, "param", name, rel_err(params[name], theirs[2][name]))
    for a, b in zip(losses, theirs[0]):
        assert rel_err(a, b) < tol, (what, "loss", losses, theirs[0])


def _run_three(loss_fn, install, stage=3):
    """(ours on the engine, TRL's own head on the engine, ours on the unpartitioned model)."""
    import fused_linear_ce

    theirs = _engine_run(_model(32, 0), loss_fn, stage=stage)
    replaced = fused_linear_ce.use_in_trl() if install else None
    try:
        mine = _engine_run(_model(32, 0), loss_fn, stage=stage)
        plain = _plain_run(_model(32, 0), loss_fn)
    finally:
        if replaced is not None:
            replaced.restore()
    return mine, theirs, plain


# --- TRL's fused LM head (SFT's loss, GRPO's per-token fields) ----------------------------------------


def _fused_head_loss(kind, outer, module):
    """TRL's ``add_fused_lm_head`` forward, run through ``outer`` (the engine, or the plain model)."""
    import trl.trainer.utils as trl_utils

    if not getattr(module, "_fused_head_added", False):
        trl_utils.add_fused_lm_head(module, temperature=0.9, outputs=("log_probs", "entropy"))
        module._fused_head_added = True
    ids, labels = _batch()
    out = outer(input_ids=ids, labels=labels, fused_lm_head=True)
    if kind == "sft":
        return out.loss
    # GRPO-style: per-token log-probs and entropy under an arbitrary upstream gradient.
    g = torch.Generator().manual_seed(2)
    u, w = torch.randn(out.log_probs.shape, generator=g), torch.randn(out.entropy.shape, generator=g)
    return (out.log_probs * u.to(out.log_probs.device)).sum() + 0.1 * (out.entropy * w.to(out.entropy.device)).sum()


def _head_worker(rank, world, port, kind):
    _init(rank, world, port)
    import fused_linear_ce.trl_head as trl_head

    calls = []
    real = trl_head.chunked_log_probs

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    trl_head.ChunkedLogProbFunction.apply = staticmethod(counted)
    mine, theirs, plain = _run_three(functools.partial(_fused_head_loss, kind), install=True)
    assert calls, "our head was not called"
    _assert_close(mine, theirs, what="ours vs TRL's on the engine")
    _assert_close(mine, plain, what="ours on the engine vs the unpartitioned model")
    _exit_cleanly()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_trl_fused_lm_head_under_zero3_equals_trls_own_and_the_plain_model(world, kind):
    _spawn(_head_worker, world, kind)


# --- TRL's distillation loss --------------------------------------------------------------------------


def _distill_loss(beta, per_token, teacher, outer, module):
    """``DistillationTrainer._compute_loss`` through ``outer`` as its ``compute_loss`` calls it, the
    teacher under its own engine (or plain); ``per_token``: TRL's ``_chunked_divergence_loss`` (which
    calls the per-token head, whose backward recomputes) instead of our loss drop-in."""
    import trl.trainer.distillation_trainer as trainer
    from trl.models.utils import _ForwardRedirection

    ids, labels = _batch()
    stub = types.SimpleNamespace(teacher_model=teacher, beta=beta, temperature=0.9, _is_vlm=False,
                                 model_kwarg_keys={"input_ids", "attention_mask", "logits_to_keep"},
                                 accelerator=types.SimpleNamespace(unwrap_model=lambda m: getattr(m, "module", m),
                                                                   is_main_process=True),
                                 _forward_redirection=_ForwardRedirection())
    stub._get_last_hidden_state = functools.partial(trainer.DistillationTrainer._get_last_hidden_state, stub)
    completion = torch.ones_like(ids[:, 5:])
    completion[0, -2:] = 0
    inputs = dict(prompt_ids=ids[:, :5], prompt_mask=torch.ones_like(ids[:, :5]), completion_ids=ids[:, 5:],
                  completion_mask=completion)
    saved = trainer._chunked_divergence_loss
    if per_token:
        trainer._chunked_divergence_loss = per_token
    try:
        loss, _, _ = stub._forward_redirection(outer, module, trainer.DistillationTrainer._compute_loss, stub, module,
                                               inputs, None)
    finally:
        trainer._chunked_divergence_loss = saved
    return loss


def _distill_worker(rank, world, port, beta):
    _init(rank, world, port)
    import fused_linear_ce
    import trl.trainer.distillation_trainer as trainer

    their_loss = trainer._chunked_divergence_loss
    plain_teacher = _model(48, 7).to(_device()).eval()
    teacher = _engine(_model(48, 7), train=False)
    runs = {}
    for name, per_token in (("loss", None), ("per-token head", their_loss)):
        for where, t in (("engine", teacher), ("plain", plain_teacher)):
            fn = functools.partial(_distill_loss, beta, per_token, t)
            if where == "engine":
                runs["theirs", name] = _engine_run(_model(32, 0), fn)
            replaced = fused_linear_ce.use_in_trl()
            try:
                runs[where, name] = (_engine_run if where == "engine" else _plain_run)(_model(32, 0), fn)
            finally:
                replaced.restore()
    for name in ("loss", "per-token head"):
        _assert_close(runs["engine", name], runs["theirs", name], what=f"{name}: ours vs TRL's on the engine")
        _assert_close(runs["engine", name], runs["plain", name], what=f"{name}: engine vs unpartitioned")
    _exit_cleanly()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_loss_under_zero3_equals_trls_own_and_the_plain_model(world, beta):
    _spawn(_distill_worker, world, beta)


# --- patch_model and the public functions --------------------------------------------------------------


def _own_loss(outer, module):
    ids, labels = _batch()
    return outer(input_ids=ids, labels=labels).loss


def _backward_gathers_again(head, h, t):
    """The heads' backward gathers the head again when it finds it partitioned (in the engine runs
    above, DeepSpeed happened to hold it gathered there): each head called with the head gathered,
    its backward (which reads the weight) run after the partition is back; grad_hidden against the
    same on the whole head's copy."""
    from fused_linear_ce import trl_distill, trl_head

    with deepspeed.zero.GatheredParameters([head.weight, head.bias]):
        whole = head.weight.detach().clone(), head.bias.detach().clone()
    g = torch.Generator().manual_seed(3)
    u = torch.randn(t.shape, generator=g).to(h.device)
    teacher = torch.randn(VOCAB, 32, generator=g).to(h.device)

    def heads(w, b):
        x = h.clone().requires_grad_()
        lp, ent, *_ = trl_head.chunked_log_probs(x, w, b, t, 0.9, 4096, None, 1.0, ("entropy",))
        div, _ = trl_distill.chunked_divergence(x, w, b, x.detach(), teacher, None, 0.5)
        return x, (lp * u).sum() + (ent * u).sum() + (div * u).sum()

    with deepspeed.zero.GatheredParameters([head.weight, head.bias]):  # as TRL's fused head gathers around it
        x, loss = heads(head.weight, head.bias)
    assert head.weight.numel() == 0 and head.bias.numel() == 0  # partitioned again for the backward
    (grad,) = torch.autograd.grad(loss, x)
    x, loss = heads(*whole)
    (expected,) = torch.autograd.grad(loss, x)
    assert rel_err(grad, expected) < 1e-5


def _patch_worker(rank, world, port):
    _init(rank, world, port)
    import fused_linear_ce

    theirs = _engine_run(_model(32, 0), _own_loss)  # the model's own loss (materialised logits)
    for strategy in ("auto", "recompute"):  # gradients formed in the forward; a backward reading the weight
        mine = _engine_run(fused_linear_ce.patch_model(_model(32, 0), strategy=strategy), _own_loss)
        plain = _plain_run(fused_linear_ce.patch_model(_model(32, 0), strategy=strategy), _own_loss)
        _assert_close(mine, theirs, what=f"{strategy}: patched vs the model's own loss on the engine")
        _assert_close(mine, plain, what=f"{strategy}: patched on the engine vs unpartitioned")

    # The public functions refuse a partitioned weight or bias before any kernel runs.
    engine = _engine(_model(32, 0))
    head = engine.module.lm_head
    assert head.weight.numel() == 0
    h = torch.randn(5, 32, device=_device())
    t = torch.randint(0, VOCAB, (5,), device=_device())
    _backward_gathers_again(head, h, t)
    calls = [lambda: fused_linear_ce.fused_linear_cross_entropy(h, head.weight, t),
             lambda: fused_linear_ce.fused_linear_logprobs(h, head.weight, t),
             lambda: fused_linear_ce.fused_linear_logprobs(h, head.weight, t[:, None], topk=True),
             lambda: fused_linear_ce.fused_linear_divergence(h, head.weight, h, head.weight, beta=0.5)]
    for call in calls:
        with pytest.raises(ValueError, match="weight is a DeepSpeed ZeRO-3 partition"):
            call()
    with deepspeed.zero.GatheredParameters([head.weight]):  # the weight whole, the bias still partitioned
        with pytest.raises(ValueError, match="bias is a DeepSpeed ZeRO-3 partition"):
            fused_linear_ce.fused_linear_cross_entropy(h, head.weight, t, head.bias)
    _exit_cleanly()


@pytest.mark.parametrize("world", WORLDS)
def test_patch_model_under_zero3_and_the_functions_refuse_a_partition(world):
    _spawn(_patch_worker, world)


# --- FSDP2 through TRL ----------------------------------------------------------------------------------


def _fsdp_worker(rank, world, port, kind):
    """FSDP2 (``fully_shard`` on the layers and the root, gloo): the student's head is whole inside the
    root's forward, where the loss runs; the teacher's, resharded after its forward, is read there as a
    DTensor, which TRL's loss, and ours, gather with ``full_tensor()``. Ours equals TRL's own: the loss
    and every gradient at each of two SGD steps."""
    from test_parallel import _init as _init_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fused_linear_ce

    _init_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))

    def sharded(model, **kwargs):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh, **kwargs)

    results = []
    for install in (False, True):
        student = _model(32, 0)
        if kind == "distill":
            # Resharded after its forward (the root keeps its parameters whole by default): its head
            # is then read as a DTensor.
            # A frozen teacher: with its head requiring grad, TRL's own loss fails in the backward here
            # (DTensor redistribute's backward: "'Tensor' object has no attribute '_local_tensor'");
            # ours passes there too (run by hand, TRL 1.16, torch 2.13).
            teacher = sharded(_model(48, 7).requires_grad_(False), reshard_after_forward=True).eval()
            loss_fn = functools.partial(_distill_loss, 0.5, None, teacher)
        else:
            import trl.trainer.utils as trl_utils

            trl_utils.add_fused_lm_head(student, temperature=0.9, outputs=("log_probs", "entropy"))
            student._fused_head_added = True
            loss_fn = functools.partial(_fused_head_loss, kind)
        student = sharded(student)
        optimizer = torch.optim.SGD(student.parameters(), lr=LR)
        steps = []
        for _ in range(2):  # two optimizer steps: the second runs on the sharded parameters the first updated
            optimizer.zero_grad()
            replaced = fused_linear_ce.use_in_trl() if install else None
            try:
                loss = loss_fn(student, student)
                loss.backward()
            finally:
                if replaced is not None:
                    replaced.restore()
            if kind == "distill":
                from torch.distributed.tensor import DTensor

                assert isinstance(teacher.lm_head.weight, DTensor)
            steps.append((loss.detach(), {n: p.grad.full_tensor() for n, p in student.named_parameters()}))
            optimizer.step()
        results.append(steps)
    for step, ((theirs, their_grads), (mine, my_grads)) in enumerate(zip(*results)):
        assert rel_err(mine, theirs) < 1e-5, (step, mine, theirs)
        for name in their_grads:
            assert rel_err(my_grads[name], their_grads[name]) < 1e-4, (step, name)
    _exit_cleanly()


@pytest.mark.skipif(ON_GPU, reason="the FSDP2 test runs on gloo (CPU)")
@pytest.mark.parametrize("kind", ["sft", "grpo", "distill"])
def test_fsdp2_through_trl_equals_trls_own(kind):
    torch.multiprocessing.spawn(_fsdp_worker, args=(2, free_port(), kind), nprocs=2, join=True)
