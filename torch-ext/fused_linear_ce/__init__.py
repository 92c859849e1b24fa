"""fused-linear-ce: cross-entropy of ``hidden @ weight.T (+ bias)`` without the (N, V) logits.

Public surface: ``fused_linear_cross_entropy``; ``fused_linear_logprobs`` (per-token log-probs,
entropy, top-1 and more, differentiable); ``ForCausalLMLoss`` (transformers' loss-function
signature, fused when given hidden states and the lm-head weight); ``layers`` (kernelize layers); the
plain-torch ``reference``; ``configs`` (block sizes and the backward plan); ``autotune`` (opt-in
tuning of the tiles for the exact shape).
"""

from . import autotune, configs, layers, reference
from .api import fused_linear_cross_entropy
from .logprobs import fused_linear_logprobs
from .layers import for_causal_lm_loss as ForCausalLMLoss

__all__ = ["ForCausalLMLoss", "autotune", "configs", "fused_linear_cross_entropy", "fused_linear_logprobs", "layers",
           "reference"]
