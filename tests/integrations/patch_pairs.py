"""What the patch_model tests share (test_patch_model.py, test_patch_model_training.py): a tiny
random Llama (hidden 32, vocabulary 128, 2 layers, 16 tokens, fp32), the unpatched model beside a
patched copy of the same weights, a batch, one training step, and the checks that the two agree."""

import copy

import torch
import transformers
from torch import nn

from conftest import DEVICE, ON_GPU, rel_err

import fused_linear_ce
from fused_linear_ce import patch_model

V, H, T, B = 128, 32, 16, 2
# fp32 relative tolerance (measured on CPU: ~3e-7; GPU reductions run in other orders and were not measured).
TOL = 1e-4 if ON_GPU else 1e-5
SMALL = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def llama(**overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, "tie_word_embeddings": False, **overrides})
    return transformers.LlamaForCausalLM(config).to(DEVICE).float()


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
    """Every parameter has a gradient in both models or in neither, and they agree to ``tol``."""
    tol = TOL if tol is None else tol
    named = dict(ours.named_parameters())
    checked = 0
    for name, p in theirs.named_parameters():
        q = named[name]
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, name
        assert rel_err(full_tensor(q.grad), p.grad) < tol, name
        checked += 1
    assert checked > 0


def full_tensor(t):
    """A DTensor gathered whole; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def step(model, *args, **kwargs):
    """The model's forward and its loss's backward: the outputs."""
    out = model(*args, **kwargs)
    out.loss.backward()
    return out


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


def with_bias():
    """The Llama with a biased head, its bias far from zero."""
    model = llama()
    torch.manual_seed(2)
    model.lm_head = nn.Linear(H, V, bias=True).to(DEVICE)
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 1.0)
    return model
