"""return_metrics: token accuracy and entropy from the same sweep; loss and gradients unchanged."""

import math

import pytest
import torch
import triton

from cases import Case, make_inputs, ours
from conftest import DEVICE, reference, rel_err
from fused_linear_ce import configs, fused_linear_cross_entropy, vocab_split

METRIC_CASES = [
    Case(77, 96, 500, torch.float32, "mean", ignored=0.2),
    Case(77, 96, 500, torch.float32, "none", bias=True, logit_scale=0.5, softcap=3.0),
    Case(33, 40, 1000, torch.float16, "sum", ignored=0.2, bias=True),
    Case(33, 40, 1000, torch.bfloat16, "mean", softcap=2.0),
    # V a multiple of every config's vocabulary tile: no tile has columns past the end (EVEN_V).
    Case(33, 40, 768, torch.bfloat16, "mean", ignored=0.2, bias=True),
]


def _peaked(case: Case):
    """Inputs where many rows' argmax is their target, so accuracy is far from 0 and from 1."""
    hidden, weight, bias, targets = make_inputs(case)
    lean = weight.float()[targets.clamp(min=0)] * (torch.arange(case.n, device=DEVICE) % 2)[:, None] * 3.0
    return (hidden.float() + lean).to(case.dtype), weight, bias, targets


@pytest.mark.parametrize("case", METRIC_CASES, ids=lambda c: c.id)
def test_metrics_match_reference(case):
    hidden, weight, bias, targets = _peaked(case)
    kw = dict(ignore_index=case.ignore_index, logit_scale=case.logit_scale, softcap=case.softcap, reduction=case.reduction)
    _, got = fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True, **kw)
    _, want = reference.linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True, **kw)
    assert 0.1 < want["mean_token_accuracy"].item() < 0.9, "the case should exercise both hits and misses"
    assert got["mean_token_accuracy"].item() == pytest.approx(want["mean_token_accuracy"].item(), abs=1e-6)
    assert rel_err(got["entropy"], want["entropy"]) < 1e-5
    for value in got.values():
        assert value.dtype == torch.float32 and value.ndim == 0 and not value.requires_grad


@pytest.mark.parametrize("case", METRIC_CASES, ids=lambda c: c.id)
def test_metrics_leave_loss_and_gradients_bit_identical(case):
    hidden, weight, bias, targets = make_inputs(case)
    (loss_m, metrics), grads_m = ours(case, hidden, weight, bias, targets, return_metrics=True)
    loss, grads = ours(case, hidden, weight, bias, targets)
    assert torch.equal(loss_m, loss)
    for k in grads:
        assert (grads[k] is None) == (grads_m[k] is None)
        if grads[k] is not None:
            assert torch.equal(grads_m[k], grads[k]), k


def test_equal_logits_give_log_v_first_index_argmax_and_full_entropy():
    n, h, v = 20, 40, 300
    hidden = torch.zeros(n, h, device=DEVICE)
    weight = torch.randn(v, h, device=DEVICE)
    targets = torch.tensor([0, 1, 299, 0] * 5, device=DEVICE)
    loss, m = fused_linear_cross_entropy(hidden, weight, targets, reduction="none", return_metrics=True)
    torch.testing.assert_close(loss, torch.full((n,), math.log(v), device=DEVICE), rtol=1e-6, atol=1e-6)
    assert m["mean_token_accuracy"].item() == pytest.approx(0.5)  # argmax of a tie is index 0
    assert m["entropy"].item() == pytest.approx(math.log(v), rel=1e-6)


def test_metrics_of_an_all_ignored_batch_are_nan():
    case = Case(9, 40, 100, ignored=1.0)
    hidden, weight, bias, targets = make_inputs(case)
    _, m = fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
    assert math.isnan(m["mean_token_accuracy"].item()) and math.isnan(m["entropy"].item())


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_argmax_ties_across_many_splits_take_the_first_class(strategy, monkeypatch):
    """The merge reduces tiles of splits at once (``combine_kernel``): here one vocabulary tile a
    split (on the CPU forced, on a GPU the split rule's choice for one row block), 41 splits, more
    than one step of the merge holds. Classes 5, 3000 and
    V - 1 have the same weight row, so each row's largest logit is tied between three splits far
    apart; the first class must win, as torch.argmax, and the loss and entropy must match the
    reference."""
    n, h, v = 24, 32, 40 * 256 + 17
    g = torch.Generator(device=DEVICE).manual_seed(3)
    # Small dyadic values: every product and sum is exact, so the three logits tie exactly.
    weight = torch.randint(-1, 2, (v, h), generator=g, device=DEVICE).float() / 8
    weight[3000] = weight[v - 1] = weight[5] = torch.randint(-2, 3, (h,), generator=g, device=DEVICE).float() / 2
    hidden = weight[5] * 2 + torch.randint(-1, 2, (n, h), generator=g, device=DEVICE).float() / 4
    targets = torch.randint(0, v, (n,), generator=g, device=DEVICE)
    targets[::2] = 5  # 12 rows: right only if the first tied class wins
    targets[1::4] = 3000  # 6 rows: right only if the middle one wins
    hidden.requires_grad_(True)
    monkeypatch.setattr(vocab_split, "_CPU_SPLITS", 10**6)
    cfg = configs.sweep_config(torch.float32, chunked=strategy == "chunked")
    if configs.interpreted() or DEVICE == "cpu":
        assert vocab_split.vocab_splits(1, triton.cdiv(v, cfg.block_v), torch.device(DEVICE)) == 41
    else:
        assert vocab_split.vocab_splits(1, triton.cdiv(v, cfg.block_v), torch.device(DEVICE), resident=cfg.resident) > 32
    loss, got = fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True, strategy=strategy)
    want_loss, want = reference.linear_cross_entropy(hidden.detach(), weight, targets, return_metrics=True)
    assert got["mean_token_accuracy"].item() == pytest.approx(want["mean_token_accuracy"].item(), abs=1e-6)
    assert got["mean_token_accuracy"].item() == pytest.approx((targets == 5).float().mean().item(), abs=1e-6)
    assert rel_err(loss.detach(), want_loss) < 1e-5
    assert rel_err(got["entropy"], want["entropy"]) < 1e-5


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_metrics_are_marked_non_differentiable(strategy):
    """The metrics are forward-only statistics: they say so (requires_grad=False), so that
    ``loss - beta * entropy`` cannot silently train on the loss alone, and backward through one of
    them raises instead of returning nothing."""
    case = Case(24, 32, 96)
    hidden, weight, bias, targets = make_inputs(case)
    h = hidden.clone().requires_grad_(True)
    loss, metrics = fused_linear_cross_entropy(h, weight, targets, return_metrics=True, strategy=strategy)
    assert loss.requires_grad
    for name, value in metrics.items():
        assert not value.requires_grad, name
    with pytest.raises(RuntimeError, match="does not require grad"):
        metrics["entropy"].backward()
