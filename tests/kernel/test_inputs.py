"""Bad input raises a clear error before any kernel runs; edge inputs behave like F.cross_entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from cases import Case, make_inputs
from conftest import DEVICE, reference, rel_err
from fused_linear_ce import fused_linear_cross_entropy, recompute, sweep


@pytest.fixture
def no_kernels(monkeypatch):
    """Fails the test if any launch happens."""

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was rejected")

    monkeypatch.setattr(sweep, "forward", refuse)
    monkeypatch.setattr(recompute, "backward", refuse)


def _good():
    h = torch.randn(4, 8, device=DEVICE)
    w = torch.randn(10, 8, device=DEVICE)
    t = torch.tensor([1, 2, 3, -100], device=DEVICE)
    return h, w, t


BAD = {
    "hidden-1d": (lambda h, w, t: (h[0], w, t, None, {}), ValueError, "hidden must be"),
    "weight-3d": (lambda h, w, t: (h, w[None], t, None, {}), ValueError, "weight must be 2-D"),
    "targets-2d": (lambda h, w, t: (h, w, t[:, None], None, {}), ValueError, "does not match hidden"),
    "H-mismatch": (lambda h, w, t: (h, w[:, :7], t, None, {}), ValueError, "hidden size mismatch"),
    "N-mismatch": (lambda h, w, t: (h, w, t[:3], None, {}), ValueError, "does not match hidden"),
    "float-targets": (lambda h, w, t: (h, w, t.float(), None, {}), TypeError, "integer"),
    "bool-targets": (lambda h, w, t: (h, w, t > 0, None, {}), TypeError, "integer"),
    "int16-targets": (lambda h, w, t: (h, w, t.to(torch.int16), None, {}), TypeError, "int64"),
    "bias-shape": (lambda h, w, t: (h, w, t, torch.zeros(9, device=DEVICE), {}), ValueError, "bias must have shape"),
    "bias-dtype": (lambda h, w, t: (h, w, t, torch.zeros(10, device=DEVICE, dtype=torch.float16), {}), TypeError, "dtype mismatch"),
    "dtype-mismatch": (lambda h, w, t: (h, w.half(), t, None, {}), TypeError, "dtype mismatch"),
    "float64": (lambda h, w, t: (h.double(), w.double(), t, None, {}), TypeError, "not supported"),
    "mixed-devices": (lambda h, w, t: (h, w.to("meta"), t, None, {}), ValueError, "one device"),
    "reduction": (lambda h, w, t: (h, w, t, None, {"reduction": "avg"}), ValueError, "reduction must be one of"),
    "softcap-zero": (lambda h, w, t: (h, w, t, None, {"softcap": 0.0}), ValueError, "softcap"),
    "softcap-negative": (lambda h, w, t: (h, w, t, None, {"softcap": -1.0}), ValueError, "softcap"),
    "softcap-inf": (lambda h, w, t: (h, w, t, None, {"softcap": math.inf}), ValueError, "softcap"),
    "scale-nan": (lambda h, w, t: (h, w, t, None, {"logit_scale": math.nan}), ValueError, "logit_scale"),
    "empty-vocab": (lambda h, w, t: (h, w[:0], t, None, {}), ValueError, "vocabulary must not be empty"),
    "chunk-bytes": (lambda h, w, t: (h, w, t, None, {"chunk_bytes": 0}), ValueError, "chunk_bytes"),
    "strategy": (lambda h, w, t: (h, w, t, None, {"strategy": "fast"}), ValueError, "strategy must be one of"),
    "chunked-none": (lambda h, w, t: (h, w, t, None, {"strategy": "chunked", "reduction": "none"}), ValueError,
                     'reduction="none"'),
    "chunked-lse": (lambda h, w, t: (h, w, t, None, {"strategy": "chunked", "return_lse": True}), ValueError,
                    "return_lse"),
    "chunked-softcap-smoothing": (lambda h, w, t: (h, w, t, None, {"strategy": "chunked", "softcap": 5.0,
                                                                   "label_smoothing": 0.1}),
                                  ValueError, "softcap together with label_smoothing"),
    "ignore-index-float": (lambda h, w, t: (h, w, t, None, {"ignore_index": -100.0}), TypeError, "ignore_index"),
    "not-a-tensor": (lambda h, w, t: (h.tolist(), w, t, None, {}), TypeError, "hidden must be a torch.Tensor"),
    # Bool options take bools: shift=2 is not a request for shift=True.
    "shift-int": (lambda h, w, t: (h, w, t, None, {"shift": 2}), TypeError, "shift must be a bool"),
    "metrics-int": (lambda h, w, t: (h, w, t, None, {"return_metrics": 1}), TypeError, "return_metrics must be a bool"),
    "lse-str": (lambda h, w, t: (h, w, t, None, {"return_lse": "yes"}), TypeError, "return_lse must be a bool"),
    "ignore-index-beyond-int64": (lambda h, w, t: (h, w, t, None, {"ignore_index": -(2**63) - 1}), ValueError,
                                  "fit in int64"),
    # No process group is initialised in this process.
    "process-group-uninitialised": (lambda h, w, t: (h, w, t, None, {"process_group": "world"}), RuntimeError,
                                    "not initialised"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_before_any_kernel(name, no_kernels):
    make, exc, message = BAD[name]
    h, w, t = _good()
    h.requires_grad_(True)
    h, w, t, b, kw = make(h, w, t)
    with pytest.raises(exc, match=message):
        fused_linear_cross_entropy(h, w, t, b, **kw)


def test_out_of_range_target_gives_nan_for_its_row_only():
    case = Case(6, 40, 100)
    hidden, weight, _, targets = make_inputs(case)
    targets[1], targets[3], targets[4] = 100, -5, 10**12
    hidden.requires_grad_(True)
    loss = fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    bad = torch.zeros(6, dtype=torch.bool, device=DEVICE)
    bad[[1, 3, 4]] = True
    assert torch.isnan(loss[bad]).all() and torch.isfinite(loss[~bad]).all()
    loss.sum().backward()
    assert torch.isnan(hidden.grad[bad]).all() and torch.isfinite(hidden.grad[~bad]).all()
    assert math.isnan(fused_linear_cross_entropy(hidden, weight, targets).item())


def test_nan_in_hidden_gives_nan_loss():
    hidden, weight, _, targets = make_inputs(Case(5, 40, 100))
    hidden[2, 7] = float("nan")
    assert math.isnan(fused_linear_cross_entropy(hidden, weight, targets).item())


@pytest.mark.parametrize("strategy", ["auto", "recompute"])  # auto: the chunked path for mean / sum
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_behaves_like_cross_entropy(reduction, strategy):
    h = torch.randn(0, 40, device=DEVICE, requires_grad=True)
    w = torch.randn(100, 40, device=DEVICE, requires_grad=True)
    b = torch.randn(100, device=DEVICE, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=DEVICE)
    loss = fused_linear_cross_entropy(h, w, t, b, reduction=reduction, strategy=strategy)
    want = F.cross_entropy(h @ w.T + b, t, reduction=reduction)
    assert loss.shape == want.shape
    assert torch.equal(torch.isnan(loss), torch.isnan(want))
    loss.sum().backward()
    assert h.grad.shape == (0, 40)
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_all_ignored_sum_is_zero_with_zero_gradients():
    case = Case(9, 40, 100, ignored=1.0, bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss = fused_linear_cross_entropy(*leaves[:2], targets, leaves[2], reduction="sum")
    assert loss.item() == 0.0
    loss.backward()
    for leaf in leaves:
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


def test_all_ignored_mean_is_nan_with_zero_gradients_like_cross_entropy():
    case = Case(9, 40, 100, ignored=1.0)
    hidden, weight, _, targets = make_inputs(case)
    hidden.requires_grad_(True)
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    assert math.isnan(loss.item())
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    case = Case(13, 40, 300, dtype, bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    wide = torch.randn(13, 3 * 40, device=DEVICE).to(dtype)
    wide[:, ::3] = hidden
    h_strided = wide[:, ::3]  # stride (120, 3)
    w_transposed = weight.T.contiguous().T  # stride (1, V)
    t_strided = torch.stack([targets, targets], 1)[:, 0]  # stride (2,)
    b_strided = torch.stack([bias, bias], 1)[:, 1]
    assert not (h_strided.is_contiguous() or w_transposed.is_contiguous() or t_strided.is_contiguous())
    got = [x.detach().clone().requires_grad_(True) for x in (h_strided, w_transposed, b_strided)]
    want = [x.detach().clone().requires_grad_(True) for x in (hidden, weight, bias)]
    loss_got = fused_linear_cross_entropy(got[0], got[1], t_strided, got[2], reduction="none")
    loss_want = fused_linear_cross_entropy(want[0], want[1], targets, want[2], reduction="none")
    torch.testing.assert_close(loss_got, loss_want, rtol=1e-6, atol=1e-6)
    g = torch.rand_like(loss_want)
    loss_got.backward(g)
    loss_want.backward(g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5)


def test_first_and_last_class_targets():
    case = Case(8, 40, 257, bias=True)
    hidden, weight, bias, _ = make_inputs(case)
    targets = torch.tensor([0, 256] * 4, device=DEVICE)
    got = fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none")
    want = reference.linear_cross_entropy(hidden, weight, targets, bias, reduction="none")
    assert rel_err(got, want) < 1e-5


def test_constant_shift_of_a_row_leaves_its_loss_unchanged():
    case = Case(8, 40, 300, bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    base = fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none")
    shifted = fused_linear_cross_entropy(hidden, weight, targets, bias + 37.5, reduction="none")
    torch.testing.assert_close(shifted, base, rtol=1e-5, atol=1e-5)


def test_int32_targets_and_integer_scale_are_accepted():
    case = Case(8, 40, 300)
    hidden, weight, _, targets = make_inputs(case)
    a = fused_linear_cross_entropy(hidden, weight, targets.int(), logit_scale=2)
    b = fused_linear_cross_entropy(hidden, weight, targets, logit_scale=2.0)
    assert torch.equal(a, b)


def test_no_grad_forward_equals_the_training_forward():
    case = Case(8, 40, 300)
    hidden, weight, _, targets = make_inputs(case)
    with torch.no_grad():
        a = fused_linear_cross_entropy(hidden.requires_grad_(True), weight, targets)
    b = fused_linear_cross_entropy(hidden, weight, targets)
    assert not a.requires_grad and b.requires_grad
    assert torch.equal(a, b.detach())


def test_gradients_accumulate_into_existing_grad():
    case = Case(8, 40, 300)
    hidden, weight, _, targets = make_inputs(case)
    hidden.requires_grad_(True)
    fused_linear_cross_entropy(hidden, weight, targets).backward()
    once = hidden.grad.clone()
    fused_linear_cross_entropy(hidden, weight, targets).backward()
    torch.testing.assert_close(hidden.grad, 2 * once)
