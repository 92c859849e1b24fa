"""patch_model: a transformers causal LM computes its loss with the fused kernel, logits=None, and
otherwise does exactly what the unpatched model does. Tiny random models (hidden 32, vocabulary 128,
2 layers, 16 tokens), fp32, the patched model against an unpatched copy from the same weights: the
real Trainer for 3 steps with gradient accumulation (Llama; Gemma-2 with its softcap and tied
embeddings; Llama with bf16=True), shift_labels, ignore_index, a bias, logit transforms read from the
forward, Mixtral's auxiliary loss, PEFT LoRA, DTensor weights and FSDP2 on a 1-rank gloo mesh, an
accelerate hook on the head, bf16 autocast over the fp32 model (the head's weight a master weight;
with FSDP2 too), generation, refusals; on a GPU, peak memory at a 32k vocabulary in bf16."""

import copy
import datetime
import os
import socket

import pytest
import torch
from torch import nn

from conftest import DEVICE, ON_GPU, rel_err

transformers = pytest.importorskip("transformers")

import fused_linear_ce  # noqa: E402
from fused_linear_ce import logit_probe, patch_model, patching, unpatch_model  # noqa: E402

V, H, T, B = 128, 32, 16, 2
# fp32 relative tolerance (measured on CPU: ~3e-7; GPU reductions run in other orders and were not measured).
TOL = 1e-4 if ON_GPU else 1e-5
SMALL = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def llama(**overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, "tie_word_embeddings": False, **overrides})
    return transformers.LlamaForCausalLM(config).to(DEVICE).float()


def gemma2(cap=2.0):
    """Gemma-2 ties its head to the embeddings. The weights are scaled so that the logits have a trained
    model's spread, where a softcap of 2 changes the loss."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=cap)
    model = transformers.Gemma2ForCausalLM(config).to(DEVICE).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


def batch(seed=1, batch_size=B):
    """Input ids, labels with a masked prompt, and padding (attention_mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch_size, T), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    mask = torch.ones_like(ids)
    mask[-1, -4:] = 0
    labels[-1, -4:] = -100
    return ids.to(DEVICE), labels.to(DEVICE), mask.to(DEVICE)


def pair(make):
    """The unpatched model and a patched copy of the same weights."""
    theirs = make()
    ours = patch_model(copy.deepcopy(theirs))
    return theirs, ours


def assert_same_grads(theirs, ours, tol=None):
    tol = TOL if tol is None else tol
    named = dict(ours.named_parameters())
    checked = 0
    for name, p in theirs.named_parameters():
        q = named[name]
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, name
        assert rel_err(_full(q.grad), p.grad) < tol, name
        checked += 1
    assert checked > 0


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def step(model, *args, **kwargs):
    out = model(*args, **kwargs)
    out.loss.backward()
    return out


# --- the real Trainer -----------------------------------------------------------------------------------


class _Rows(torch.utils.data.Dataset):
    """12 rows with varying counted tokens, so num_items_in_batch differs between micro-batches."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.rows = []
        for i in range(12):
            ids = torch.randint(0, V, (T,), generator=g)
            labels = ids.clone()
            labels[: 2 + i % 5] = -100
            mask = torch.ones(T, dtype=torch.int64)
            if i % 3 == 0:
                mask[-3:] = 0
                labels[-3:] = -100
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def kernel_inputs(monkeypatch):
    """Records (hidden dtype, weight dtype, whether the weight is a DTensor) of every call that reaches
    the kernel's ops (the loss's and the per-token function's), in order."""
    seen = []
    for module in (fused_linear_ce.ops, fused_linear_ce.tokens):
        def spy(hidden, weight, *args, _real=module.apply, **kwargs):
            seen.append((hidden.dtype, weight.dtype, type(weight).__name__ == "DTensor"))
            return _real(hidden, weight, *args, **kwargs)

        monkeypatch.setattr(module, "apply", spy)
    return seen


def same_steps(theirs, ours, ids, mask, labels, counts):
    """One step of each model per ``num_items_in_batch`` in ``counts`` (None: not passed), from zeroed
    gradients: the same loss and gradients every time. Returns the last (unpatched, patched) outputs."""
    for num_items in counts:
        for m in (theirs, ours):
            m.zero_grad()
        kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
        want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
        got = step(ours, input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
        torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
        assert_same_grads(theirs, ours)
    return want, got


def train(model, tmp_path, steps=3, bf16=False):
    """3 optimizer steps of transformers.Trainer with 2 micro-batches each: the per-micro-batch losses,
    the accumulated gradients before each optimizer step, what the forward returned. Plain SGD: Adam
    divides by the root of the squared gradient, which turns roundoff in gradients near zero into
    differences of a whole learning rate."""
    record = {"loss": [], "grads": [], "num_items": [], "logits": []}

    class Grads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            record["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if p.grad is not None})

    class Recording(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            record["loss"].append(loss.detach().clone())
            record["num_items"].append(num_items_in_batch)
            record["logits"].append(outputs.get("logits"))
            return (loss, outputs) if return_outputs else loss

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        optim="sgd", learning_rate=0.5, logging_steps=1, report_to=[], save_strategy="no", use_cpu=not ON_GPU, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=bf16,
    )
    trainer = Recording(model=model, args=args, train_dataset=_Rows(), callbacks=[Grads()])
    trainer.train()
    return record


@pytest.mark.parametrize("make", [llama, gemma2], ids=["llama", "gemma2-softcap-tied"])
def test_trainer_steps_give_the_unpatched_losses_and_gradients(make, tmp_path):
    theirs, ours = pair(make)
    if make is gemma2:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied
    want = train(theirs, tmp_path / "plain")
    got = train(ours, tmp_path / "patched")
    assert len(got["loss"]) == len(want["loss"]) == 6 and len(got["grads"]) == len(want["grads"]) == 3
    # Trainer passed num_items_in_batch (gradient accumulation), and it varies between steps.
    assert all(n is not None for n in got["num_items"]) and len({int(n) for n in got["num_items"]}) > 1
    assert all(lg is None for lg in got["logits"]) and all(lg is not None for lg in want["logits"])
    for a, b in zip(got["loss"], want["loss"]):
        torch.testing.assert_close(a, b.float(), rtol=TOL, atol=1e-6)
    for g_ours, g_theirs in zip(got["grads"], want["grads"]):
        assert g_ours.keys() == g_theirs.keys()
        for name in g_theirs:
            assert rel_err(g_ours[name], g_theirs[name]) < TOL, name
    if make is gemma2:  # the softcap matters at this spread: uncapped, the loss is far from the model's
        uncapped = patch_model(gemma2(cap=None))
        ids, labels, mask = batch()
        with torch.no_grad():
            capped = patch_model(gemma2())(input_ids=ids, attention_mask=mask, labels=labels).loss
            assert abs(uncapped(input_ids=ids, attention_mask=mask, labels=labels).loss - capped) > 0.1


def test_trainer_with_bf16_on_an_fp32_model_sums_the_head_gradient_in_fp32(tmp_path, monkeypatch):
    """Trainer(bf16=True) on an fp32 model (its forward under bf16 autocast): the kernel gets the head's
    fp32 weight as a master weight on every micro-batch, and the losses and accumulated gradients
    follow the unpatched model's to bf16's precision (its head rounds logits and gradients to bf16)."""
    seen = kernel_inputs(monkeypatch)
    theirs, ours = pair(llama)
    want = train(theirs, tmp_path / "plain", steps=2, bf16=True)
    got = train(ours, tmp_path / "patched", steps=2, bf16=True)
    assert seen == [(torch.bfloat16, torch.float32, False)] * 4
    assert all(lg is None for lg in got["logits"])
    for a, b in zip(got["loss"], want["loss"]):
        assert rel_err(a, b.float()) < 1e-2
    for g_ours, g_theirs in zip(got["grads"], want["grads"]):
        assert g_ours["lm_head.weight"].dtype == torch.float32
        for name in g_theirs:
            assert rel_err(g_ours[name], g_theirs[name]) < 5e-2, name


# --- what the model's forward does with labels ------------------------------------------------------------


def test_shift_labels_are_used_as_given_with_or_without_labels():
    theirs, ours = pair(llama)
    ids, labels, mask = batch()
    g = torch.Generator().manual_seed(5)
    shift = torch.randint(0, V, (B, T), generator=g).to(DEVICE)  # not labels shifted: proves it is used
    shift[:, ::3] = -100
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift)
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    assert_same_grads(theirs, ours)
    # shift_labels alone: transformers' model computes no loss without labels; the patched one does.
    alone = ours(input_ids=ids, attention_mask=mask, shift_labels=shift)
    assert alone.logits is None
    torch.testing.assert_close(alone.loss, want.loss, rtol=TOL, atol=1e-6)


def test_ignore_index_num_items_and_metrics():
    """-100 prompt and padding positions count for nothing; num_items_in_batch divides the sum (an int
    and a 0-d tensor); the metrics equal those of the unpatched logits."""
    theirs = llama()
    ours = patch_model(copy.deepcopy(theirs), return_metrics=True)
    ids, labels, mask = batch()
    want, got = same_steps(theirs, ours, ids, mask, labels, (None, 19, torch.tensor(23, device=DEVICE)))
    logits = want.logits.detach()[:, :-1]
    targets = labels[:, 1:]
    counted = targets != -100
    accuracy = (logits.argmax(-1) == targets)[counted].float().mean()
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)[counted].mean()
    torch.testing.assert_close(got["mean_token_accuracy"], accuracy, rtol=TOL, atol=1e-6)
    torch.testing.assert_close(got["entropy"], entropy, rtol=TOL, atol=1e-6)
    assert "mean_token_accuracy" not in theirs(input_ids=ids, labels=labels)


def _with_bias():
    model = llama()
    torch.manual_seed(2)
    model.lm_head = nn.Linear(H, V, bias=True).to(DEVICE)
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 1.0)
    return model


def test_lm_head_bias():
    theirs, ours = pair(_with_bias)
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    assert ours.lm_head.bias.grad is not None
    assert_same_grads(theirs, ours)


@pytest.mark.parametrize("hook", [lambda o: o * 0.5, lambda o: 3.0 * torch.tanh(o.float() / 4.0 * 2.0 / 3.0),
                                  lambda o: (o / 8.0).mul_(2.0)], ids=["scale", "scaled-softcap", "in-place"])
def test_logit_transforms_are_read_from_what_the_forward_does(hook):
    """Cohere's ``* logit_scale``, Granite's ``/ logits_scaling``, Gemma's ``c * tanh(z / c)``, here as a
    forward hook on the head (which the patched head runs too): the kernel's logit_scale and softcap."""
    theirs, ours = pair(llama)
    for m in (theirs, ours):
        m.lm_head.register_forward_hook(lambda module, args, out: hook(out))
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    assert_same_grads(theirs, ours)


def test_an_accelerate_hook_on_the_head_still_runs():
    """accelerate's hooks (device placement, offload) wrap the head's forward and keep the original as
    ``_old_forward``: the stub stands in for that, so the hook runs around it."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Halve(ModelHook):
        def post_forward(self, module, output):
            return output / 2.0

    theirs, ours = pair(llama)
    for m in (theirs, ours):
        add_hook_to_module(m.lm_head, Halve())
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    assert_same_grads(theirs, ours)


@pytest.mark.parametrize("hook", [lambda o: o + 1.0, lambda o: o[..., :100], lambda o: torch.tanh(torch.tanh(o)),
                                  lambda o: o * torch.ones(1, device=o.device, requires_grad=True), lambda o: o * -2.0 * torch.tanh(o)],
                         ids=["add", "slice", "tanh-tanh", "learned-scale", "logits-times-logits"])
def test_other_logit_transforms_raise(hook):
    model = llama()
    model.lm_head.register_forward_hook(lambda module, args, out: hook(out))
    patch_model(model)
    ids, labels, _ = batch()
    with pytest.raises(ValueError, match="patch_model"):
        model(input_ids=ids, labels=labels)


def test_mixtral_adds_its_router_auxiliary_loss():
    def make():
        torch.manual_seed(0)
        config = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                            output_router_logits=True, router_aux_loss_coef=0.5)
        return transformers.MixtralForCausalLM(config).to(DEVICE).float()

    theirs, ours = pair(make)
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert got.aux_loss is not None and got.logits is None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=0)
    assert abs((want.loss - 0.5 * want.aux_loss) - want.loss) > 1e-3  # the auxiliary term matters
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    assert_same_grads(theirs, ours)


# --- PEFT ---------------------------------------------------------------------------------------------------


def _lora(model, targets=("q_proj", "v_proj")):
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM",
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("when", ["after-wrapping", "before-wrapping"])
def test_peft_lora(when):
    theirs = _lora(llama())
    ours = patch_model(_lora(llama())) if when == "after-wrapping" else _lora(patch_model(llama()))
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    lora = [n for n, p in ours.named_parameters() if p.grad is not None]
    assert lora and all("lora_" in n for n in lora)
    assert_same_grads(theirs, ours)


def test_peft_lora_on_the_lm_head_is_refused():
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):
        patch_model(_lora(llama(), ("q_proj", "lm_head")))
    model = _lora(patch_model(llama()), ("q_proj", "lm_head"))
    ids, labels, _ = batch()
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):
        model(input_ids=ids, labels=labels)


# --- DTensor weights ---------------------------------------------------------------------------------------------


@pytest.fixture
def gloo_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON_GPU, reason="CPU/gloo test (Triton interpreter); the kernel's NCCL path: test_parallel_nccl.py")
def test_dtensor_weights_on_a_one_rank_mesh(gloo_mesh, monkeypatch):
    """Shard(0) is vocabulary parallelism over the mesh's group, Replicate the local tensor; gradients
    reach the DTensor parameters. Other placements raise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    groups = []
    kernel = patching.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        groups.append(kwargs["process_group"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(patching, "fused_linear_cross_entropy", spy)
    ids, labels, mask = batch()
    theirs = _with_bias()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    for placement, group in ((Shard(0), gloo_mesh.get_group()), (Replicate(), None)):
        ours = copy.deepcopy(theirs)
        ours.zero_grad()
        for name in ("weight", "bias"):
            param = getattr(ours.lm_head, name)
            setattr(ours.lm_head, name, nn.Parameter(distribute_tensor(param.detach(), gloo_mesh, [placement])))
        patch_model(ours)
        got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
        assert groups.pop() is group
        torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
        assert type(ours.lm_head.weight.grad).__name__ == "DTensor"
        assert_same_grads(theirs, ours)
    ours = copy.deepcopy(theirs)
    ours.lm_head.weight = nn.Parameter(distribute_tensor(ours.lm_head.weight.detach(), gloo_mesh, [Shard(1)]))
    ours.lm_head.bias = None
    with pytest.raises(ValueError, match=r"placements \(Shard\(dim=1\),\)"):
        patch_model(ours)(input_ids=ids, labels=labels)


@pytest.mark.skipif(ON_GPU, reason="CPU/gloo test (Triton interpreter)")
def test_fsdp2_root_unit_gives_plain_weights_in_the_forward(gloo_mesh, monkeypatch):
    """fully_shard on the layers and the root (which holds the lm head): the loss runs inside the root's
    forward, where the weights are unsharded plain tensors (no process group), and the gradients reach
    the sharded parameters. An lm head sharded as a unit of its own is refused."""
    from torch.distributed.fsdp import fully_shard

    groups = []
    kernel = patching.fused_linear_cross_entropy
    monkeypatch.setattr(patching, "fused_linear_cross_entropy",
                        lambda *a, **k: groups.append(k["process_group"]) or kernel(*a, **k))
    theirs = llama()
    ours = copy.deepcopy(theirs)
    for layer in ours.model.layers:
        fully_shard(layer, mesh=gloo_mesh)
    fully_shard(ours, mesh=gloo_mesh)
    assert type(ours.lm_head.weight).__name__ == "DTensor"
    patch_model(ours)
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert groups == [None]
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    assert_same_grads(theirs, ours)
    alone = copy.deepcopy(theirs)
    fully_shard(alone.lm_head, mesh=gloo_mesh)
    with pytest.raises(ValueError, match="FSDP unit of its own"):
        patch_model(alone)


@pytest.mark.skipif(ON_GPU, reason="CPU/gloo test (Triton interpreter)")
def test_fsdp2_with_fp32_parameters_under_bf16_autocast_hands_the_kernel_a_master_weight(gloo_mesh, monkeypatch):
    """FSDP2 over fp32 parameters (no param_dtype: the master weights are the parameters) with the
    forward under bf16 autocast: inside the root's forward the lm head's unsharded weight is a plain
    fp32 tensor, which the kernel takes as a master weight (gradient summed in fp32); the sharded
    parameters get fp32 gradients that agree with the unpatched model's to bf16's precision."""
    from torch.distributed.fsdp import fully_shard

    seen = kernel_inputs(monkeypatch)
    theirs = llama()
    ours = copy.deepcopy(theirs)
    for layer in ours.model.layers:
        fully_shard(layer, mesh=gloo_mesh)
    fully_shard(ours, mesh=gloo_mesh)
    patch_model(ours)
    ids, labels, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
        got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert seen == [(torch.bfloat16, torch.float32, False)]
    assert rel_err(got.loss, want.loss) < 1e-2
    grad = ours.lm_head.weight.grad
    assert type(grad).__name__ == "DTensor" and grad.dtype == torch.float32
    assert_same_grads(theirs, ours, tol=5e-2)


# --- untouched without labels, unpatching, refusals ---------------------------------------------------------------------


def test_without_labels_the_model_is_untouched():
    theirs, ours = pair(llama)
    ids, labels, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits,
                                   theirs(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)
        assert ours(input_ids=ids, labels=labels).logits is None
    prompt = ids[:, :6]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kwargs), theirs.generate(prompt, **kwargs))
    # return_dict=False: the tuple without the logits, as transformers drops None entries.
    loss, *rest = ours(input_ids=ids, labels=labels, return_dict=False)
    assert loss.ndim == 0 and all(not isinstance(r, logit_probe.LogitsProbe) for r in rest)


def test_patch_is_idempotent_and_unpatch_restores():
    model = llama()
    forward = model.forward
    assert patch_model(model) is model
    patched = model.forward
    patch_model(model, return_metrics=True)
    assert model.forward.__func__ is patched.__func__  # not wrapped twice; the options updated
    ids, labels, _ = batch()
    with torch.no_grad():
        assert "entropy" in model(input_ids=ids, labels=labels)
        assert unpatch_model(model) is model
        assert "forward" not in vars(model) and model.forward == forward
        assert model(input_ids=ids, labels=labels).logits is not None
    assert unpatch_model(model) is model  # a no-op


def test_refusals():
    ids, labels, _ = batch()
    with pytest.raises(ValueError, match="logits_to_keep"):
        patch_model(llama())(input_ids=ids, labels=labels, logits_to_keep=1)
    custom = llama()
    custom.loss_function = lambda *a, **k: 0.0
    with pytest.raises(ValueError, match="custom function"):
        patch_model(custom)
    with pytest.raises(ValueError, match="output embedding"):
        patch_model(transformers.LlamaModel(transformers.LlamaConfig(**SMALL)))
    with pytest.raises(ValueError, match="strategy"):
        patch_model(llama(), strategy="fast")
    twice = llama()
    twice.lm_head.register_forward_hook(lambda module, args, out: module.forward(args[0]))
    with pytest.raises(ValueError, match="twice"):
        patch_model(twice)(input_ids=ids, labels=labels)


# --- GPU: memory -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (peak memory)")
@pytest.mark.tier
def test_peak_memory_is_lower_than_unpatched_at_a_32k_vocabulary():
    """bf16 Llama, vocabulary 32000, 4 x 1024 tokens: the unpatched forward + backward holds the bf16
    logits, their fp32 copy and its gradient; the patched one none of them."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=False)
    theirs = transformers.LlamaForCausalLM(config).to(DEVICE, torch.bfloat16)
    ours = patch_model(copy.deepcopy(theirs))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (4, 1024), generator=g).to(DEVICE)

    def peak(model):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.cuda.synchronize()
        loss = out.loss.detach().float()
        del out
        return torch.cuda.max_memory_allocated() - base, loss

    peak(ours)  # compile the kernels first
    want_bytes, want = peak(theirs)
    got_bytes, got = peak(ours)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
    logits_bytes = 4 * 1024 * 32000 * 4  # one fp32 copy of the logits
    assert got_bytes < want_bytes - logits_bytes, (got_bytes / 2**20, want_bytes / 2**20)
    assert_same_grads(theirs, ours, tol=5e-2)


def test_per_token_fields_on_request_with_the_same_loss_and_gradients():
    """outputs=(...): the per-token fields under their names (shifted positions, 0 where ignored and at
    the last position), the loss from the same sweep equal to the unpatched model's, log_probs and
    entropy differentiable; metrics from the same fields."""
    theirs = llama()
    fields = ("log_probs", "entropy", "is_top1")
    ours = patch_model(copy.deepcopy(theirs), outputs=fields, return_metrics=True)
    ids, labels, mask = batch()
    want, got = same_steps(theirs, ours, ids, mask, labels, (None, 19))
    logits = want.logits.detach().float()
    scored = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    counted = scored != -100
    logp = logits.log_softmax(-1)
    expected = {
        "log_probs": torch.where(counted, logp.gather(-1, scored.clamp(min=0)[..., None])[..., 0], 0.0),
        "entropy": torch.where(counted, -(logp.exp() * logp).sum(-1), 0.0),
        "is_top1": counted & (logits.argmax(-1) == scored),
    }
    for name in fields:
        assert got[name].shape == labels.shape, name
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], rtol=TOL, atol=1e-5)
    torch.testing.assert_close(got["entropy"], expected["entropy"], rtol=TOL, atol=1e-5)
    assert torch.equal(got["is_top1"], expected["is_top1"])
    assert got["log_probs"].requires_grad and got["entropy"].requires_grad
    torch.testing.assert_close(got["mean_token_accuracy"], expected["is_top1"][counted].float().mean())
    with pytest.raises(ValueError, match="unknown outputs"):
        patch_model(llama(), outputs=("perplexity",))


@pytest.mark.parametrize("outputs", [(), ("log_probs", "entropy")], ids=["loss", "per-token"])
def test_fp32_model_under_bf16_autocast_keeps_the_head_weight_fp32(outputs, monkeypatch):
    """Trainer(bf16=True) on an fp32 model runs the forward under torch.autocast(bfloat16): the head's
    fp32 weight reaches the kernel as it is, a master weight (cast inside the op, its gradient summed
    in fp32 and never rounded to bf16: docs/design.md), for the loss and for the per-token fields; the
    loss and every gradient agree with the unpatched model under the same autocast to bf16's
    precision (the unpatched head rounds its logits and its weight gradient to bf16)."""
    seen = kernel_inputs(monkeypatch)
    theirs = llama()
    ours = patch_model(copy.deepcopy(theirs), outputs=outputs)
    ids, labels, mask = batch()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        want = step(theirs, ids, attention_mask=mask, labels=labels)
        got = step(ours, ids, attention_mask=mask, labels=labels)
    assert seen == [(torch.bfloat16, torch.float32, False)]
    assert got.logits is None and ours.lm_head.weight.grad.dtype == torch.float32
    assert rel_err(got.loss, want.loss) < 1e-2
    assert_same_grads(theirs, ours, tol=5e-2)
