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
