"""A drop-in for TRL's fused LM head: the call contract of TRL 1.16's
``trl.kernels.ChunkedLogProbFunction.apply``, computed by ``fused_linear_logprobs``.

TRL's trainers (SFT, GRPO, RLOO, DPO, KTO) patch the model with ``trl.trainer.utils.add_fused_lm_head``,
which calls ``ChunkedLogProbFunction.apply`` for the per-token fields. ``use_in_trl()`` makes it call
this kernel instead (two lines in a training script; see the README), and TRL's distillation trainer
use ``trl_distill``'s. Written from TRL's public signature and docstrings only.
"""

import torch

from .logprobs import fused_linear_logprobs
from .partitioned import gathered
from .plan import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNKED_BYTES
from .validate import check_chunk_bytes

# TRL's ``outputs`` default: the optional fields, log_probs being always computed.
TRL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# The drop-in's largest memory budget. It stands where TRL's head held its chunk's logits and their
# gradient (3285 MiB above the inputs at 65536 x 4096 x 128256, bf16, H200), so by default it spends
# more where that buys time: 6 N H bytes, the hosted fp32 (N, H) accumulator's extra half (2 N H)
# and a da block of twice that, one pass of 16 vocabulary blocks at H = 4096 (1.5 GiB there), at most
# 2 GiB. Measured there (H200, interleaved, SFT): 447 ms at 1538 MiB against TRL's 447 ms at 3285
# MiB and the package default's 486 ms at 514 MiB (benchmarks/results/dropin/).
TRL_MAX_CHUNK_BYTES = 2 << 30


def trl_chunk_bytes(hidden) -> int | None:
    """The drop-in's default ``chunk_bytes`` for ``hidden`` (..., H): None (the package's defaults,
    each path's own: 192 MiB recompute, 256 MiB chunks) while 6 N H bytes (the recompute backward's
    hosted fp32 (N, H) accumulator, whose extra half takes a third of the budget) is within the
    larger of them, as at N H <= 32 Mi (8192 x 4096, 16384 x 2048); beyond, 6 N H bytes, at most
    TRL_MAX_CHUNK_BYTES. None for a non-tensor too (the op's checks report it)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        return None
    budget = min(6 * hidden.numel(), TRL_MAX_CHUNK_BYTES)
    return budget if budget > max(DEFAULT_CHUNK_BYTES, DEFAULT_CHUNKED_BYTES) else None


def chunked_log_probs(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                      logit_scale=1.0, outputs=TRL_OUTPUTS):
    """``ChunkedLogProbFunction.apply(hidden [N, H], weight [V, H], bias [V] | None, targets [N],
    temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0, outputs)`` ->
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each (N,) fp32 (bool for
    is_top1), None where not in ``outputs`` (log_probs always). The logits are
    ``softcap((hidden @ weight.T + bias) * logit_scale) / temperature``; the product runs in the
    autocast dtype under autocast, else in hidden's dtype (weight and bias are cast to it, with
    their gradients flowing back in their own dtype; an fp32 weight under a 16-bit autocast gets
    its gradient summed in fp32, ``fused_linear_logprobs``). ``chunk_size`` (TRL passes 32768) is
    accepted and not used: the kernel tiles the vocabulary itself. Its memory budget is
    ``trl_chunk_bytes(hidden)`` (``use_in_trl(chunk_bytes=)`` sets another). log_probs and entropy
    carry gradients; the others do not."""
    return _log_probs(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                      outputs, None)


def _log_probs(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs,
               chunk_bytes):
    """``chunked_log_probs`` with a memory budget: ``chunk_bytes``, or ``trl_chunk_bytes`` when None."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if chunk_bytes is None:
        chunk_bytes = trl_chunk_bytes(hidden)
    # ZeRO-3: TRL gathers the head around this call; the backward gathers again where it reads them.
    with gathered(weight, bias, trl=True):
        if isinstance(hidden, torch.Tensor) and not torch.is_autocast_enabled(hidden.device.type):
            weight = weight.to(hidden.dtype) if isinstance(weight, torch.Tensor) else weight
            bias = bias.to(hidden.dtype) if isinstance(bias, torch.Tensor) else bias
        # Under autocast, fused_linear_logprobs casts hidden and bias, and an fp32 weight inside the op.
        wanted = ("log_probs", *outputs)
        out = fused_linear_logprobs(hidden, weight, targets, bias, temperature=temperature, logit_scale=logit_scale,
                                    softcap=final_logit_softcapping, outputs=wanted, chunk_bytes=chunk_bytes)
    return tuple(out.get(name) for name in ("log_probs", *TRL_OUTPUTS))


class ChunkedLogProbFunction:
    """Stands where TRL's ``ChunkedLogProbFunction`` stands: only ``apply`` is called."""

    apply = staticmethod(chunked_log_probs)


class Replaced(dict):
    """What ``use_in_trl`` replaced: {"module.attribute": what was there}; ``restore()`` puts each back."""

    def restore(self) -> None:
        import importlib

        for where, previous in self.items():
            module, name = where.rsplit(".", 1)
            setattr(importlib.import_module(module), name, previous)


def use_in_trl(*, chunk_bytes=None, divergence_chunk_bytes=None) -> Replaced:
    """Makes TRL's fused LM head (``add_fused_lm_head``, every trainer's loss head) compute its
    per-token fields with this kernel, for every model patched from now on and those already patched;
    and TRL's distillation trainer (``trl.trainer.distillation_trainer``: its ``ChunkedDivergenceFunction``
    and its ``_chunked_divergence_loss``) its divergence with ``fused_linear_divergence``
    (``trl_distill``), where the installed TRL has them.
    Two budgets, one a head, each its function's memory knob (counted differently):

    - ``chunk_bytes``: the LM head's (``fused_linear_logprobs``'); None: ``trl_chunk_bytes`` (the
      package default up to 16384 x 2048 or 8192 x 4096 tokens x hidden, 6 N H bytes beyond, at most
      2 GiB).
    - ``divergence_chunk_bytes``: the distillation's (``fused_linear_divergence``': a chunk's two fp32
      logit rows and da, ``plan.DEFAULT_DIVERGENCE_BYTES`` by default); None: ``chunk_bytes`` when
      that is given (one budget for both), else the divergence's default.

    Returns what it replaced, a ``Replaced`` {"module.attribute": previous}:
    ``.restore()`` undoes it. Under DeepSpeed ZeRO-3 every installed head gathers the partitioned head
    weights and biases it reads, through TRL's ``maybe_gather_lm_head_ctx``, in its forward and again
    in a backward that reads them (``partitioned.gathered``). Raises RuntimeError when the installed
    TRL does not have the head this replaces (TRL 1.16's ``trl.trainer.utils._ChunkedLogProbFunction``),
    ValueError for a bad budget."""
    check_chunk_bytes(chunk_bytes)
    check_chunk_bytes(divergence_chunk_bytes)
    head = ChunkedLogProbFunction if chunk_bytes is None else _head_with_budget(chunk_bytes)
    try:
        import trl.trainer.utils as trl_utils
    except ImportError as exc:
        raise RuntimeError("use_in_trl needs TRL (pip install trl)") from exc
    if not hasattr(trl_utils, "_ChunkedLogProbFunction"):
        import trl

        raise RuntimeError(f"TRL {trl.__version__} has no trl.trainer.utils._ChunkedLogProbFunction to replace; "
                           "this drop-in follows TRL 1.16's fused LM head")
    replaced = Replaced({"trl.trainer.utils._ChunkedLogProbFunction": trl_utils._ChunkedLogProbFunction})
    trl_utils._ChunkedLogProbFunction = head
    from . import trl_distill

    previous = trl_distill.install(chunk_bytes if divergence_chunk_bytes is None else divergence_chunk_bytes)
    replaced.update((f"trl.trainer.distillation_trainer.{name}", was) for name, was in previous.items())
    return replaced


def _head_with_budget(chunk_bytes: int):
    """A ``ChunkedLogProbFunction`` whose ``apply`` (TRL's contract) runs within ``chunk_bytes``."""

    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=TRL_OUTPUTS):
        return _log_probs(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                          logit_scale, outputs, chunk_bytes)

    return type("ChunkedLogProbFunction", (), {"apply": staticmethod(apply), "__doc__": ChunkedLogProbFunction.__doc__,
                                               "chunk_bytes": chunk_bytes})


__all__ = ["ChunkedLogProbFunction", "Replaced", "chunked_log_probs", "trl_chunk_bytes", "use_in_trl"]
