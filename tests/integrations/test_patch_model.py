"""patch_model on a model's forward: a transformers causal LM computes its loss with the fused kernel,
logits=None, and otherwise does exactly what the unpatched model does. Tiny random models
(tests/integrations/patch_pairs.py), the patched model against an unpatched copy from the same weights:
shift_labels, ignore_index, num_items_in_batch and the metrics, a bias, logit transforms read from the
forward, an accelerate hook on the head, Mixtral's auxiliary loss, per-token fields, bf16 autocast over
the fp32 model (the head's weight a master weight), generation and the model without labels,
unpatching, refusals; on a GPU, peak memory at a 32k vocabulary in bf16. The Trainer, PEFT, DTensor
and FSDP2: test_patch_model_training.py."""

import copy

import pytest
import torch

from conftest import DEVICE, ON_GPU, rel_err

transformers = pytest.importorskip("transformers")
pytest.register_assert_rewrite("patch_pairs")

from fused_linear_ce import logit_probe, patch_model, unpatch_model  # noqa: E402
from patch_pairs import (  # noqa: E402
    SMALL, TOL, B, T, V, assert_same_grads, batch, kernel_inputs, llama, pair, step, with_bias,
)


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


def test_lm_head_bias():
    theirs, ours = pair(with_bias)
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


# --- per-token fields, bf16 autocast -------------------------------------------------------------------


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
