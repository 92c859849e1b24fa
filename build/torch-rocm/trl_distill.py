"""A drop-in for TRL's distillation head: the call contract of TRL 1.16's
``trl.kernels.chunked_divergence.ChunkedDivergenceFunction.apply`` and of the trainer's
``trl.trainer.distillation_trainer._chunked_divergence_loss``, computed by ``fused_linear_divergence``.

``DistillationTrainer`` calls ``_chunked_divergence_loss``, which calls the head for per-token
divergences and sums them. Per token, the upstream gradient is only known in the backward, so the
head recomputes the logits there (six products); the loss equivalent here asks for the masked sum
instead, whose gradients are formed in the forward (four products). ``use_in_trl()`` installs both.
Written from TRL's public signatures and docstrings and its trainer's code (what it passes, what it
does with the result).
"""

import torch

from . import ops
from .distill import fused_linear_divergence
from .partitioned import gathered


def _operands(hs, ws, bs, ht, wt, bt):
    """The tensors in the one dtype ``fused_linear_divergence`` takes, computing what TRL's head computes:
    each model's product in its hidden states' dtype (its weight cast to it) with fp32 accumulation, so
    two models in different dtypes both go in the wider one (exact: a 16-bit value is one in fp32).
    Under autocast, every operand goes in the autocast dtype (``fused_linear_divergence`` casts them).
    A bias goes in that dtype too (TRL's adds an fp32 bias to the fp32 logits unrounded; ours rounds it
    to 16 bits with 16-bit hidden states, a relative 1e-5 on the logits)."""
    if not isinstance(hs, torch.Tensor) or not isinstance(ht, torch.Tensor) or torch.is_autocast_enabled(
            hs.device.type):
        return hs, ws, bs, ht, wt, bt
    dtype = torch.promote_types(hs.dtype, ht.dtype)  # fp16 with bf16: fp32

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t

    if isinstance(ws, torch.Tensor) and ws.dtype != hs.dtype:
        ws = ws.to(hs.dtype)  # rounded as TRL's head rounds it, then widened exactly
    if isinstance(wt, torch.Tensor) and wt.dtype != ht.dtype:
        wt = wt.to(ht.dtype)
    return tuple(cast(t) for t in (hs, ws, bs, ht, wt, bt))


def chunked_divergence(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                       beta, temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None,
                       teacher_logit_scale=1.0, teacher_final_logit_softcapping=None):
    """``ChunkedDivergenceFunction.apply(student_hidden [N, H_s], student_weight [V, H_s], student_bias |
    None, teacher_hidden [N, H_t], teacher_weight [V, H_t], teacher_bias | None, beta, temperature=1.0,
    student_logit_scale=1.0, student_final_logit_softcapping=None, teacher_logit_scale=1.0,
    teacher_final_logit_softcapping=None)`` -> ``(per_token_divergence (N,), per_token_entropy (N,))``,
    fp32. beta 0: forward KL(teacher || student), 1: reverse KL(student || teacher), between: the
    generalized JSD with mixture ``(1 - beta) p_student + beta p_teacher``. Each model's logits are
    ``softcap((hidden @ weight.T + bias) * logit_scale) / temperature``; the products in the autocast
    dtype under autocast, else in each model's hidden dtype (the wider of the two when they differ,
    ``_operands``). The gradient reaches the student's tensors only; the entropy (the student's) has
    none. The backward recomputes the logits (the per-token upstream is only known there)."""
    return _divergence(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                       beta, temperature, student_logit_scale, student_final_logit_softcapping, teacher_logit_scale,
                       teacher_final_logit_softcapping, None)


def _divergence(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
                temperature, student_logit_scale, student_final_logit_softcapping, teacher_logit_scale,
                teacher_final_logit_softcapping, chunk_bytes):
    """``chunked_divergence`` within ``chunk_bytes``."""
    # ZeRO-3: both heads gathered for the forward, and again in the backward, which recomputes.
    with gathered(student_weight, student_bias, teacher_weight, teacher_bias, trl=True):
        hs, ws, bs, ht, wt, bt = _operands(student_hidden, student_weight, student_bias, teacher_hidden,
                                           teacher_weight, teacher_bias)
        div, fields = fused_linear_divergence(
            hs, ws, ht, wt, beta=beta, student_bias=bs, teacher_bias=bt, temperature=temperature,
            student_logit_scale=student_logit_scale, student_softcap=student_final_logit_softcapping,
            teacher_logit_scale=teacher_logit_scale, teacher_softcap=teacher_final_logit_softcapping,
            reduction="none", outputs=("entropy",), chunk_bytes=chunk_bytes)
    return div, fields["entropy"].detach()


class ChunkedDivergenceFunction:
    """Stands where TRL's ``ChunkedDivergenceFunction`` stands: only ``apply`` is called."""

    apply = staticmethod(chunked_divergence)


def chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                            teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                            student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                            teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                            teacher_final_logit_softcapping=None, temperature=1.0):
    """TRL 1.16's ``_chunked_divergence_loss`` (same arguments): ``(loss, entropy_sum, n_valid)`` over
    the positions where ``completion_mask`` (B, K) is nonzero: the summed divergence divided by
    ``num_items_in_batch`` when given, else by the number of valid positions (at least 1: a fully
    masked batch gives 0); the student's entropy summed over them (no gradient); their count (int64,
    0-d). Hidden states (B, K, H_s) and (B, K, H_t), each model with its own width. One call of
    ``fused_linear_divergence`` with the mask and the division inside (gradients formed in the forward,
    four products), no host sync. FSDP2's DTensor weights are gathered whole and cast to the hidden
    states' dtype first, as TRL does."""
    return _loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                 completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias,
                 student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
                 teacher_final_logit_softcapping, temperature, None)


def _loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
          completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias, student_logit_scale,
          teacher_logit_scale, student_final_logit_softcapping, teacher_final_logit_softcapping, temperature,
          chunk_bytes):
    """``chunked_divergence_loss`` within ``chunk_bytes``. ZeRO-3: both heads gathered around the call
    (the teacher's forward has returned by then, so nothing else gathers it)."""
    with gathered(student_lm_head_weight, student_lm_head_bias, teacher_lm_head_weight, teacher_lm_head_bias,
                  trl=True):
        return _gathered_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                              teacher_lm_head_weight, completion_mask, beta, num_items_in_batch, student_lm_head_bias,
                              teacher_lm_head_bias, student_logit_scale, teacher_logit_scale,
                              student_final_logit_softcapping, teacher_final_logit_softcapping, temperature,
                              chunk_bytes)


def _gathered_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                   completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias,
                   student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
                   teacher_final_logit_softcapping, temperature, chunk_bytes):
    """``_loss`` with the heads' weights whole."""
    student_lm_head_weight, student_lm_head_bias = _full(student_lm_head_weight, student_lm_head_bias,
                                                         student_hidden_states)
    teacher_lm_head_weight, teacher_lm_head_bias = _full(teacher_lm_head_weight, teacher_lm_head_bias,
                                                         teacher_hidden_states)
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    rows_s = student_hidden_states.reshape(-1, student_hidden_states.size(-1))
    rows_t = teacher_hidden_states.reshape(-1, teacher_hidden_states.size(-1))
    if num_items_in_batch is None:
        divisor = n_valid.clamp(min=1)
    else:
        divisor = ops.count_tensor(num_items_in_batch, rows_s.device)
    if rows_s.shape[0] == 0:  # no positions: TRL's empty sum, 0 with a graph to the student
        zero = student_lm_head_weight.sum().float() * 0 + rows_s.sum().float() * 0
        return zero / divisor, zero.detach(), n_valid
    hs, ws, bs, ht, wt, bt = _operands(rows_s, student_lm_head_weight, student_lm_head_bias, rows_t,
                                       teacher_lm_head_weight, teacher_lm_head_bias)
    loss, fields = fused_linear_divergence(
        hs, ws, ht, wt, beta=beta, student_bias=bs, teacher_bias=bt, temperature=temperature,
        student_logit_scale=student_logit_scale, student_softcap=student_final_logit_softcapping,
        teacher_logit_scale=teacher_logit_scale, teacher_softcap=teacher_final_logit_softcapping, mask=valid,
        reduction="sum", num_items_in_batch=divisor, outputs=("entropy",), chunk_bytes=chunk_bytes)
    return loss, fields["entropy"].sum().detach(), n_valid


def _full(weight, bias, hidden):
    """A DTensor weight (FSDP2) as one plain tensor in hidden's dtype, its bias whole (TRL's handling)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return weight, bias
    if isinstance(weight, DTensor):
        weight = weight.full_tensor().to(hidden.dtype)
        if bias is not None:
            bias = bias.full_tensor()
    return weight, bias


def with_budget(chunk_bytes):
    """The two drop-ins (head, loss), running within ``chunk_bytes`` (``fused_linear_divergence``'s
    knob; None: its default)."""
    if chunk_bytes is None:
        return ChunkedDivergenceFunction, chunked_divergence_loss

    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
              temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None):
        return _divergence(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                           beta, temperature, student_logit_scale, student_final_logit_softcapping,
                           teacher_logit_scale, teacher_final_logit_softcapping, chunk_bytes)

    def loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
             completion_mask, beta, num_items_in_batch=None, student_lm_head_bias=None, teacher_lm_head_bias=None,
             student_logit_scale=1.0, teacher_logit_scale=1.0, student_final_logit_softcapping=None,
             teacher_final_logit_softcapping=None, temperature=1.0):
        return _loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                     completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias,
                     student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
                     teacher_final_logit_softcapping, temperature, chunk_bytes)

    head = type("ChunkedDivergenceFunction", (), {"apply": staticmethod(apply), "chunk_bytes": chunk_bytes,
                                                  "__doc__": ChunkedDivergenceFunction.__doc__})
    loss.__doc__ = chunked_divergence_loss.__doc__
    return head, loss


# Where TRL's distillation trainer looks each drop-in up: (module, attribute).
TRL_DISTILL_NAMES = ("ChunkedDivergenceFunction", "_chunked_divergence_loss")


def install(chunk_bytes=None) -> dict:
    """Puts the head and the loss into ``trl.trainer.distillation_trainer``; returns {attribute: what
    was there}. {} when the installed TRL has no distillation trainer of this shape (TRL < 1.16)."""
    try:
        import trl.trainer.distillation_trainer as trainer
    except ImportError:
        return {}
    if not all(hasattr(trainer, name) for name in TRL_DISTILL_NAMES):
        return {}
    previous = {name: getattr(trainer, name) for name in TRL_DISTILL_NAMES}
    for name, ours in zip(TRL_DISTILL_NAMES, with_budget(chunk_bytes)):
        setattr(trainer, name, ours)
    return previous


__all__ = ["ChunkedDivergenceFunction", "chunked_divergence", "chunked_divergence_loss", "install", "with_budget"]
