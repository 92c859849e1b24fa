"""kernelize-compatible layers and a transformers-compatible loss function.

``ForCausalLMLoss`` has the signature of transformers' ``ForCausalLMLoss`` loss function, plus
``hidden_states`` / ``lm_head_weight`` / ``lm_head_bias``: given those, it computes the causal-LM loss
with the fused kernel and never needs the logits (pass ``logits=None``); without them it falls back
to the logits it was given, exactly as transformers does (upcast to fp32, then cross-entropy), since
the logits then already exist. The layer class of the same name wraps it for ``kernels.kernelize``:
a host module decorated ``@use_kernel_forward_from_hub("ForCausalLMLoss")`` whose ``forward`` has
this signature gets its forward replaced.
"""

import functools

from torch import nn

from .api import fused_linear_cross_entropy


# What a transformers model's forward passes on to its loss function besides the loss's own
# arguments (transformers' ``TransformersKwargs``): attention and output switches, none of which
# changes the loss.
PASSED_THROUGH = frozenset({
    "output_hidden_states", "output_attentions", "output_router_logits", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "position_ids", "is_causal", "seq_idx", "use_cache", "return_dict",
})
# The model's logit transforms, as its config names them; applied on the fused path, where the loss
# computes the logits (``logits = softcap(a * logit_scale / logits_scaling)``), and already in the
# logits when they are given.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@functools.cache
def _passed_through() -> frozenset:
    """PASSED_THROUGH and whatever the installed transformers adds to its ``TransformersKwargs``
    (read once: the loss runs every step)."""
    try:
        from transformers.utils.generic import TransformersKwargs
    except ImportError:
        return PASSED_THROUGH
    return PASSED_THROUGH | frozenset(TransformersKwargs.__annotations__) - {"num_items_in_batch"}


def _check_kwargs(kwargs) -> None:
    if not kwargs:
        return
    unknown = sorted(set(kwargs) - set(LOGIT_TRANSFORMS) - _passed_through())
    if unknown:
        raise TypeError(f"ForCausalLMLoss got unexpected keyword arguments {unknown}: it applies "
                        f"{list(LOGIT_TRANSFORMS)} and ignores transformers' pass-through kwargs "
                        f"({sorted(PASSED_THROUGH)}); anything else would be silently dropped")


def for_causal_lm_loss(
    logits,
    labels,
    vocab_size: int,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    hidden_states=None,
    lm_head_weight=None,
    lm_head_bias=None,
    **kwargs,
):
    """transformers' ``ForCausalLMLoss`` contract: labels are shifted (position t predicts t + 1)
    unless ``shift_labels`` is given; the mean is over counted tokens, or the sum divided by
    ``num_items_in_batch`` when given.

    Keyword arguments: the model's logit transforms (``LOGIT_TRANSFORMS``: Gemma-2's
    ``final_logit_softcapping``, Cohere's ``logit_scale`` multiplier, Granite's ``logits_scaling``
    divisor) are applied on the fused path, where this function computes the logits; given logits
    already carry them, as in transformers. transformers' pass-through kwargs (attention and output
    switches) change nothing and are ignored; any other keyword raises TypeError."""
    _check_kwargs(kwargs)
    if hidden_states is None or lm_head_weight is None:
        if logits is None:
            raise ValueError("ForCausalLMLoss needs logits, or hidden_states and lm_head_weight")
        logits = logits.float().reshape(-1, vocab_size)
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = nn.functional.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
        return loss / num_items_in_batch if num_items_in_batch is not None else loss
    if lm_head_weight.shape[0] != vocab_size:
        raise ValueError(f"lm_head_weight has {lm_head_weight.shape[0]} rows but vocab_size is {vocab_size}")
    scale = kwargs.get("logit_scale")
    divisor = kwargs.get("logits_scaling")
    logit_scale = (1.0 if scale is None else scale) / (1.0 if divisor is None else divisor)
    targets = shift_labels if shift_labels is not None else labels
    return fused_linear_cross_entropy(
        hidden_states, lm_head_weight, targets.to(hidden_states.device), lm_head_bias, ignore_index=ignore_index,
        logit_scale=logit_scale, softcap=kwargs.get("final_logit_softcapping"), shift=shift_labels is None,
        num_items_in_batch=num_items_in_batch,
    )


class ForCausalLMLoss(nn.Module):
    """kernelize layer: the forward of a host module with ``for_causal_lm_loss``'s signature."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        logits,
        labels,
        vocab_size: int,
        num_items_in_batch=None,
        ignore_index: int = -100,
        shift_labels=None,
        hidden_states=None,
        lm_head_weight=None,
        lm_head_bias=None,
        **kwargs,
    ):
        return for_causal_lm_loss(
            logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, hidden_states,
            lm_head_weight, lm_head_bias, **kwargs,
        )


class LinearCrossEntropy(nn.Module):
    """kernelize layer for a host module ``forward(self, hidden, weight, targets, bias=None)`` that
    returns the mean cross-entropy of ``hidden @ weight.T + bias``."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden, weight, targets, bias=None):
        return fused_linear_cross_entropy(hidden, weight, targets, bias)


__all__ = ["ForCausalLMLoss", "LinearCrossEntropy", "for_causal_lm_loss"]
