"""fused_linear_divergence's input checks: every bad input (shapes, dtypes, options, outputs, budgets)
raises its error before any kernel runs; tensors on two devices are refused (GPU)."""

import math

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fused_linear_ce import divergence, fused_linear_divergence
pytest.register_assert_rewrite("divergence_cases")
from divergence_cases import H_S, H_T, N, V, divergence_inputs  # noqa: E402


BAD = {
    "vocabulary": (ValueError, dict(teacher_weight=torch.randn(V + 1, H_T))),
    "student_width": (ValueError, dict(student_weight=torch.randn(V, H_S + 1))),
    "teacher_width": (ValueError, dict(teacher_hidden=torch.randn(N, H_T - 1))),
    "rows": (ValueError, dict(teacher_hidden=torch.randn(N + 1, H_T))),
    "beta_high": (ValueError, dict(beta=1.5)),
    "beta_nan": (ValueError, dict(beta=math.nan)),
    "beta_missing": (TypeError, dict(beta=None)),
    "temperature": (ValueError, dict(temperature=0.0)),
    "softcap": (ValueError, dict(student_softcap=-1.0)),
    "teacher_softcap": (ValueError, dict(teacher_softcap=0.0)),
    "dtype": (TypeError, dict(teacher_weight=torch.randn(V, H_T, dtype=torch.float16))),
    "float64": (TypeError, dict(student_hidden=torch.randn(N, H_S, dtype=torch.float64),
                                student_weight=torch.randn(V, H_S, dtype=torch.float64))),
    "targets_float": (TypeError, dict(targets=torch.zeros(N))),
    "targets_shape": (ValueError, dict(targets=torch.zeros(N + 1, dtype=torch.long))),
    "mask_dtype": (TypeError, dict(mask=torch.ones(N))),
    "reduction": (ValueError, dict(reduction="max")),
    "strategy": (ValueError, dict(strategy="fast")),
    "chunked_none": (ValueError, dict(strategy="chunked", reduction="none")),
    "num_items_none": (ValueError, dict(reduction="none", num_items_in_batch=3)),
    "outputs_unknown": (ValueError, dict(outputs=("argmax",))),
    "outputs_str": (TypeError, dict(outputs="entropy")),
    "log_probs_without_targets": (ValueError, dict(targets=None, outputs=("log_probs",))),
    "empty": (ValueError, dict(student_hidden=torch.randn(0, H_S), teacher_hidden=torch.randn(0, H_T),
                               targets=torch.zeros(0, dtype=torch.long))),
    "chunk_bytes": (ValueError, dict(chunk_bytes=0)),
    "bias_shape": (ValueError, dict(student_bias=torch.randn(V - 1))),
}


def _no_kernel(*args, **kwargs):
    raise AssertionError("a kernel ran before the input check")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_before_any_kernel(case, monkeypatch):
    error, change = BAD[case]
    args = {**divergence_inputs(torch.float32), "beta": 0.5}
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in change.items()})
    if args["beta"] is None:
        del args["beta"]
    monkeypatch.setattr(divergence, "_launch", _no_kernel)
    monkeypatch.setattr(divergence, "_logits", _no_kernel)
    with pytest.raises(error):
        fused_linear_divergence(**args)


def test_device_mismatch():
    if not ON_GPU:
        pytest.skip("needs a second device")
    inputs = divergence_inputs(torch.float32)
    inputs["teacher_weight"] = inputs["teacher_weight"].cpu()
    with pytest.raises(ValueError, match="one device"):
        fused_linear_divergence(**inputs, beta=0.5)
