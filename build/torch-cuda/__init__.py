"""fused-linear-ce: cross-entropy of ``hidden @ weight.T (+ bias)`` without the (N, V) logits.

Public surface: ``fused_linear_cross_entropy``; ``ForCausalLMLoss`` (transformers' loss-function
signature, fused when given hidden states and the lm-head weight); ``layers`` (kernelize layers); the
plain-torch ``reference``; ``configs`` (block sizes and the backward plan); ``autotune`` (opt-in
tuning of the tiles for the exact shape); ``patch_model`` / ``unpatch_model`` (a transformers causal LM
computes its loss with the fused kernel, ``logits=None``).
"""

from . import autotune, configs, layers, reference
from .api import fused_linear_cross_entropy
from .layers import for_causal_lm_loss as ForCausalLMLoss
from .patching import patch_model, unpatch_model

__all__ = ["ForCausalLMLoss", "autotune", "configs", "fused_linear_cross_entropy", "layers", "patch_model", "reference", "unpatch_model"]
