"""fused-linear-ce: cross-entropy of ``hidden @ weight.T (+ bias)`` without the (N, V) logits.

Public surface: ``fused_linear_cross_entropy``; ``fused_linear_logprobs`` (per-token log-probs,
entropy, top-1 and more, differentiable); ``fused_linear_divergence`` (distillation: the
student-teacher KL / JSD from both LM heads); ``ChunkedLogProbFunction`` and ``use_in_trl`` (the drop-ins
for TRL's fused LM head, ``trl_head``, and its distillation head and loss, ``trl_distill``); ``ForCausalLMLoss`` (transformers' loss-function
signature, fused when given hidden states and the lm-head weight); ``layers`` (kernelize layers); the
plain-torch ``reference``; ``configs`` (block sizes and the backward plan); ``autotune`` (opt-in
tuning of the tiles for the exact shape); ``patch_model`` / ``unpatch_model`` (a transformers causal LM
computes its loss with the fused kernel, ``logits=None``).
"""

from . import autotune, configs, layers, reference, trl_distill, trl_head
from .api import fused_linear_cross_entropy
from .distill import fused_linear_divergence
from .logprobs import fused_linear_logprobs
from .trl_head import ChunkedLogProbFunction, use_in_trl
from .layers import for_causal_lm_loss as ForCausalLMLoss
from .patching import patch_model, unpatch_model

__all__ = ["ChunkedLogProbFunction", "ForCausalLMLoss", "autotune", "configs", "fused_linear_cross_entropy",
           "fused_linear_divergence", "fused_linear_logprobs", "layers", "patch_model", "reference", "trl_distill",
           "trl_head", "unpatch_model", "use_in_trl"]
