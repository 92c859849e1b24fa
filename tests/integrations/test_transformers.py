"""transformers: our ForCausalLMLoss on a real (tiny, random) Llama equals the model's own loss and
gradients; and the kernelize path through kernels' LocalLayerRepository."""

import copy
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, REPO, rel_err

transformers = pytest.importorskip("transformers")
import kernels  # noqa: E402

from fused_linear_ce import ForCausalLMLoss, layers  # noqa: E402

VOCAB = 300


def _model():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEVICE).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return ids, labels


@pytest.mark.parametrize("num_items", [None, 17], ids=["mean", "num_items_in_batch"])
def test_loss_from_hidden_states_equals_the_models_own_loss_and_gradients(num_items):
    ids, labels = _batch()
    theirs, ours = _model(), None
    ours = copy.deepcopy(theirs)
    kwargs = {} if num_items is None else {"num_items_in_batch": num_items}

    want = theirs(input_ids=ids, labels=labels, **kwargs).loss
    want.backward()

    hidden = ours.model(input_ids=ids).last_hidden_state
    got = ForCausalLMLoss(None, labels, VOCAB, hidden_states=hidden, lm_head_weight=ours.lm_head.weight, **kwargs)
    got.backward()

    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-4, name


def test_logits_path_matches_transformers_loss_function():
    from transformers.loss.loss_utils import ForCausalLMLoss as reference_loss

    ids, labels = _batch()
    logits = torch.randn(2, 12, VOCAB, device=DEVICE)
    for kwargs in ({}, {"num_items_in_batch": 9}):
        torch.testing.assert_close(ForCausalLMLoss(logits, labels, VOCAB, **kwargs),
                                   reference_loss(logits, labels, VOCAB, **kwargs))


class _HostLoss(torch.nn.Module):
    """What a user's model holds: a loss module marked for kernelize. Its own forward refuses to
    run, so a result proves the kernel's layer replaced it."""

    def forward(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                hidden_states=None, lm_head_weight=None, lm_head_bias=None, **kwargs):
        raise AssertionError("the host forward ran: kernelize did not replace it")


def test_kernelize_swaps_in_the_fused_layer_from_a_local_repository():
    host_cls = kernels.use_kernel_forward_from_hub("ForCausalLMLoss")(_HostLoss)
    holder = torch.nn.Module()
    holder.loss = host_cls()
    repo = kernels.LocalLayerRepository(Path(REPO) / "build" / "torch-cuda", layer_name="ForCausalLMLoss")
    mapping = {"ForCausalLMLoss": {DEVICE.type: {kernels.Mode.TRAINING: repo}}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(holder, mode=kernels.Mode.TRAINING, device=DEVICE.type)
    _, labels = _batch()
    hidden = torch.randn(2, 12, 64, device=DEVICE, requires_grad=True)
    weight = torch.randn(VOCAB, 64, device=DEVICE, requires_grad=True)
    got = holder.loss(None, labels, VOCAB, hidden_states=hidden, lm_head_weight=weight)
    want = ForCausalLMLoss(None, labels, VOCAB, hidden_states=hidden, lm_head_weight=weight)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.backward()
    assert hidden.grad is not None and weight.grad is not None


def test_gemma2_softcap_reaches_the_fused_loss():
    """Gemma-2 caps its logits (``final_logit_softcapping``) before its loss; passed as transformers
    names it, the fused loss applies it and equals the model's own loss and gradients."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, final_logit_softcapping=2.0,
    )
    torch.manual_seed(0)
    theirs = transformers.Gemma2ForCausalLM(config).to(DEVICE).float()
    with torch.no_grad():  # logits of a trained model's spread (std ~10), where a cap of 2 matters
        theirs.lm_head.weight.mul_(60.0)
    ours = copy.deepcopy(theirs)
    ids, labels = _batch()
    want = theirs(input_ids=ids, labels=labels).loss
    want.backward()
    hidden = ours.model(input_ids=ids).last_hidden_state
    got = ForCausalLMLoss(None, labels, VOCAB, hidden_states=hidden, lm_head_weight=ours.lm_head.weight,
                          final_logit_softcapping=config.final_logit_softcapping)
    uncapped = ForCausalLMLoss(None, labels, VOCAB, hidden_states=hidden.detach(), lm_head_weight=ours.lm_head.weight)
    assert abs(uncapped.item() - want.item()) > 0.1  # the cap matters at this size
    got.backward()
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        if p.grad is not None:
            assert rel_err(q.grad, p.grad) < 1e-4, name


@pytest.mark.parametrize("kwargs", [{"logit_scale": 0.25}, {"logits_scaling": 4.0},
                                    {"logit_scale": 2.0, "logits_scaling": 8.0, "final_logit_softcapping": 3.0}],
                         ids=["cohere-scale", "granite-scaling", "all"])
def test_logit_transforms_are_applied_on_the_fused_path(kwargs):
    """The config's logit multipliers as the models apply them to their logits: ``* logit_scale``
    (Cohere), ``/ logits_scaling`` (Granite), then the softcap; the logits path takes them as
    already applied, as transformers does."""
    _, labels = _batch()
    hidden = torch.randn(2, 12, 64, device=DEVICE)
    weight = torch.randn(VOCAB, 64, device=DEVICE) * 0.3
    logits = hidden @ weight.T * kwargs.get("logit_scale", 1.0) / kwargs.get("logits_scaling", 1.0)
    if "final_logit_softcapping" in kwargs:
        cap = kwargs["final_logit_softcapping"]
        logits = cap * torch.tanh(logits / cap)
    want = ForCausalLMLoss(logits, labels, VOCAB, **kwargs)
    got = ForCausalLMLoss(None, labels, VOCAB, hidden_states=hidden, lm_head_weight=weight, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unknown_keyword_arguments_raise_and_pass_through_ones_do_not():
    """transformers passes its TransformersKwargs (attention and output switches) to every loss
    function; those change nothing. Anything else would be silently dropped, so it raises."""
    _, labels = _batch()
    hidden = torch.randn(2, 12, 64, device=DEVICE)
    weight = torch.randn(VOCAB, 64, device=DEVICE)
    plain = ForCausalLMLoss(None, labels, VOCAB, hidden_states=hidden, lm_head_weight=weight)
    passed = ForCausalLMLoss(None, labels, VOCAB, hidden_states=hidden, lm_head_weight=weight,
                             output_attentions=False, position_ids=torch.arange(12), cu_seq_lens_q=None)
    assert torch.equal(plain, passed)
    for logits, extra in ((None, dict(hidden_states=hidden, lm_head_weight=weight)), (hidden @ weight.T, {})):
        with pytest.raises(TypeError, match="final_logits_softcap"):
            ForCausalLMLoss(logits, labels, VOCAB, final_logits_softcap=30.0, **extra)
