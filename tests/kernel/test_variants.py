"""The loss variants: label smoothing, z-loss, class weights, the returned lse, per-token
log-probabilities. All in the same sweep; each checked against the float64 reference, whose own
formulas are checked against F.cross_entropy here too."""

import pytest
import torch
import torch.nn.functional as F

from cases import Case, check_three_way, class_weights, make_inputs, ours
from conftest import DEVICE, reference, rel_err
from fused_linear_ce import fused_linear_cross_entropy

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

CASES = []
for dtype in DTYPES:
    for reduction in ("mean", "sum", "none"):
        CASES += [
            Case(77, 96, 500, dtype, reduction, ignored=0.2, label_smoothing=0.1),
            Case(77, 96, 500, dtype, reduction, ignored=0.2, class_weight=True, bias=True),
            Case(77, 96, 500, dtype, reduction, ignored=0.2, z_loss=1e-3, softcap=5.0),
        ]
    CASES += [
        Case(77, 96, 500, dtype, "mean", ignored=0.2, label_smoothing=0.2, class_weight=True, z_loss=1e-2,
             logit_scale=0.7, bias=True),
        Case(77, 96, 500, dtype, "none", label_smoothing=1.0, class_weight=True),
        Case(77, 96, 500, dtype, "mean", ignored=1.0, label_smoothing=0.1, class_weight=True),
    ]
    # token blocks (+ V x H accumulator) / vocabulary blocks (16-bit: the N x H accumulator borrowed
    # from grad_weight) / one pass with N x H in the budget
    for chunk in (16 * 500 * dtype.itemsize, 77 * 256 * dtype.itemsize, 72000):
        CASES.append(Case(77, 96, 500, dtype, "sum", ignored=0.2, label_smoothing=0.1, class_weight=True,
                          z_loss=1e-3, bias=True, chunk_bytes=chunk))
    # 16-bit: borrowed, with grad_weight blocks that wait for grad_hidden / two passes (V < 2N)
    for n, v in ((160, 1000), (300, 500)):
        CASES.append(Case(n, 40, v, dtype, "mean", ignored=0.2, label_smoothing=0.1, class_weight=True,
                          z_loss=1e-3, bias=True, chunk_bytes=n * 256 * dtype.itemsize))


@pytest.mark.tier_if(lambda case: case.logit_scale == 0.7)  # every variant at once, each dtype
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_variant_matches_float64_reference(case):
    check_three_way(case)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
@pytest.mark.parametrize("weighted", [False, True])
def test_reference_is_cross_entropy(reduction, smoothing, weighted):
    """The reference's label smoothing and class weights are F.cross_entropy's, ignored rows included."""
    case = Case(40, 16, 50, ignored=0.3, class_weight=weighted)
    hidden, weight, _, targets = make_inputs(case)
    w = class_weights(case)
    got = reference.linear_cross_entropy(hidden, weight, targets, reduction=reduction, label_smoothing=smoothing,
                                         class_weight=w)
    z = hidden.double() @ weight.double().T
    want = F.cross_entropy(z, targets, weight=None if w is None else w.double(), reduction=reduction,
                           label_smoothing=smoothing)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_z_loss_adds_its_penalty_and_gradient():
    case = Case(33, 40, 300, bias=True, ignored=0.2)
    hidden, weight, bias, targets = make_inputs(case)
    base = fused_linear_cross_entropy(hidden, weight, targets, bias)
    with_z = fused_linear_cross_entropy(hidden, weight, targets, bias, z_loss=0.5)
    lse = torch.logsumexp(hidden.double() @ weight.double().T + bias.double(), -1)
    counted = targets != -100
    expected = 0.5 * lse[counted].square().mean()
    assert abs((with_z - base).item() - expected.item()) < 1e-5 * expected.item()


def test_returned_lse_is_exact_and_differentiable():
    case = Case(33, 40, 300, torch.float32, "mean", ignored=0.2, bias=True, softcap=4.0)
    hidden, weight, bias, targets = make_inputs(case)
    r = torch.randn(33, device=DEVICE)

    def step(fn):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        loss, lse = fn(*leaves[:2], targets, leaves[2], softcap=4.0, return_lse=True)
        (loss + (lse * r).sum()).backward()
        return lse.detach(), [t.grad for t in leaves]

    lse, grads = step(fused_linear_cross_entropy)
    ref_lse, ref_grads = step(reference.linear_cross_entropy)
    assert lse.shape == (33,) and lse.dtype == torch.float32
    assert rel_err(lse, ref_lse) < 1e-6
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) < 1e-5


def test_lse_with_metrics_keeps_the_documented_order():
    hidden, weight, _, targets = make_inputs(Case(9, 40, 100))
    loss, metrics, lse = fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True, return_lse=True)
    assert loss.ndim == 0 and {"mean_token_accuracy", "entropy"} <= set(metrics) and lse.shape == (9,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_log_probs_in_a_policy_gradient_step(dtype):
    """reduction="none" is -log p(target) per token with a per-row upstream gradient: a REINFORCE /
    GRPO-style step with a different advantage per row matches log_softmax(...).gather(...)."""
    case = Case(48, 64, 700, dtype)
    hidden, weight, _, targets = make_inputs(case)
    advantages = torch.randn(48, device=DEVICE)
    mask = (torch.arange(48, device=DEVICE) % 5 != 0).float()  # padded completion tokens

    def pg_loss(logp):
        return -(advantages * logp * mask).sum() / mask.sum()

    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = -fused_linear_cross_entropy(h1, w1, targets, reduction="none")
    pg_loss(logp).backward()

    h2, w2 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp_ref = torch.log_softmax(h2 @ w2.T, -1).gather(1, targets[:, None])[:, 0]
    pg_loss(logp_ref).backward()
    tol = 1e-5 if dtype == torch.float32 else 1.2e-2
    assert rel_err(logp, logp_ref) < (1e-6 if dtype == torch.float32 else 1e-5)
    assert rel_err(h1.grad, h2.grad) < tol and rel_err(w1.grad, w2.grad) < tol


def test_metrics_stay_bit_identical_with_every_variant():
    case = Case(77, 96, 500, torch.bfloat16, "mean", ignored=0.2, label_smoothing=0.1, z_loss=1e-3,
                class_weight=True, bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    (loss_m, _), grads_m = ours(case, hidden, weight, bias, targets, return_metrics=True)
    loss, grads = ours(case, hidden, weight, bias, targets)
    assert torch.equal(loss_m, loss)
    for k in grads:
        assert torch.equal(grads_m[k], grads[k]), k


BAD = {
    "smoothing>1": ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    "smoothing<0": ({"label_smoothing": -0.1}, ValueError, "label_smoothing"),
    "z-loss<0": ({"z_loss": -1.0}, ValueError, "z_loss"),
    "z-loss-nan": ({"z_loss": float("nan")}, ValueError, "z_loss"),
    "cw-shape": ({"class_weight": torch.ones(7)}, ValueError, "class_weight must have shape"),
    "cw-int": ({"class_weight": torch.ones(10, dtype=torch.long)}, TypeError, "floating-point"),
    "cw-grad": ({"class_weight": torch.ones(10, requires_grad=True)}, ValueError, "no gradient"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_variant_arguments_raise(name, monkeypatch):
    from fused_linear_ce import sweep

    monkeypatch.setattr(sweep, "forward", lambda *a, **k: pytest.fail("kernel ran"))
    kw, exc, message = BAD[name]
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and not v.requires_grad else v) for k, v in kw.items()}
    hidden, weight, _, targets = make_inputs(Case(4, 8, 10))
    with pytest.raises(exc, match=message):
        fused_linear_cross_entropy(hidden, weight, targets, **kw)
