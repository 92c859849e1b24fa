"""fused-linear-ce: cross-entropy of ``hidden @ weight.T (+ bias)`` without the (N, V) logits.

Public surface: ``fused_linear_cross_entropy`` and the plain-torch ``reference``.
"""

from . import configs, reference
from .api import fused_linear_cross_entropy

__all__ = ["configs", "fused_linear_cross_entropy", "reference"]
